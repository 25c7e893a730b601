"""The draft_model drafter: a small model of the target's family, run by an inner `Engine`.

The drafter owns a second engine over the draft model, on the target's device and dtype,
with its own paged KV cache (of the target's --kv-cache-dtype) and prefix caching and no
speculation of its own. It follows every request as any drafter does (`start_request` /
`add_tokens` / `finish_request`) and drafts in rounds: the first `propose` after requests
kept new tokens drafts greedily for all of them at once, each as a request of its prompt
and output so far for up to K tokens, stepped in one batch until all are done; the
proposals are kept and later `propose` calls of the same step are answered from them (cut
to the k asked). The inner engine's prefix cache holds each request's earlier rounds, so a
round computes little more than the tokens kept since the last one and the K drafted.

Drafts are greedy, so they are a deterministic function of the request's tokens:
verification treats them as one-hot proposals, which its acceptance rule already handles
exactly, and seeded sampling stays reproducible. The draft's tokenizer must be the
target's (the same `shared.tokenizer_digest`), so both models' ids mean the same text;
their vocabularies may differ in padding only, and a draft id past the target's vocabulary
ends the proposal there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_worker.core.config import EngineConfig
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.loader import load_config
from gpu_worker.runner.kv_caches import model_kv_bytes_per_block, resolve_kv_cache_dtype
from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.draft_length import DraftStep
from shared.model_source import ModelSource, resolve_model
from shared.protocol import Generate, RequestDelta
from shared.sampling import SamplingParams
from shared.tokenizer_digest import tokenizer_digest

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class DraftTarget:
    """What the draft engine takes from the target engine it drafts for."""

    config: EngineConfig
    """The target's arguments: block size, batch limits, backend and CUDA-graph settings."""
    source: ModelSource
    """The target model's files, whose tokenizer the draft model must share."""
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    """The target's vocabulary (with padding): drafts stop before an id past it."""
    num_kv_tokens: int
    """Tokens the draft's KV cache is sized for: the target's cache capacity suits, as a
    draft sequence is its target sequence plus at most K tokens."""


@dataclass
class _DraftState:
    """One request as the drafter follows it."""

    token_ids: list[int]
    """Prompt then the output kept so far."""
    num_prompt_tokens: int
    drafts: list[int] | None = None
    """The proposal for the current `token_ids`; None until a round drafts it."""
    pending: list[int] = field(default_factory=list)
    """Tokens the inner engine drafted in the round under way."""
    num_cached: int = 0
    """Of `token_ids`, the ones the inner engine's prefix cache holds: the full blocks of
    the latest round's tokens."""


class DraftEngine(Protocol):
    """What the drafter runs its rounds on: an engine over the draft model
    (`gpu_worker.engine.engine.Engine`, which hands itself in as the factory)."""

    config: EngineConfig
    max_model_len: int
    last_step_tokens: int

    def add_request(self, request: Generate, request_key: str | None = None) -> None: ...

    def step(self) -> list[RequestDelta]: ...

    def abort(self, request_keys: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_request(self, request_id: str) -> bool: ...


DraftEngineFactory = Callable[..., DraftEngine]
"""Builds the draft engine from engine arguments (model, device, dtype, limits...)."""


class DraftModelDrafter:
    """A `Drafter` whose proposals are a draft model's greedy continuations."""

    def __init__(
        self, config: SpeculativeConfig, target: DraftTarget, engine_factory: DraftEngineFactory
    ) -> None:
        """Load the draft model into an inner engine; a ValueError names the draft model
        and the target when their tokenizers differ (checked before any weight loads)."""
        assert config.method == "draft_model" and config.model is not None
        draft_source = _check_same_tokenizer(config.model, target.source)
        target_config = target.config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.target_vocab_size = target.vocab_size
        self.engine = engine_factory(
            model=config.model,
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            # The same rounding of keys and values as the target's cache, and as many
            # tokens per byte (`_kv_cache_gb` sizes the draft cache by it).
            kv_cache_dtype=target_config.kv_cache_dtype,
            block_size=target_config.block_size,
            max_num_seqs=target_config.max_num_seqs,
            max_num_batched_tokens=target_config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            kv_cache_memory_gb=_kv_cache_gb(config, target, draft_source),
            attention_backend=target_config.attention_backend,
            enforce_eager=(
                target_config.enforce_eager
                if config.enforce_eager is None
                else config.enforce_eager
            ),
            cuda_graph_max_batch_size=target_config.cuda_graph_max_batch_size,
            cpu_gguf_kernels=target_config.cpu_gguf_kernels,
            enable_prefix_caching=True,
        )
        """The draft model's engine: requests appear in it only during a round."""
        self.num_rounds = 0
        """Batched drafting rounds run since start (one per engine step that drafted)."""
        self._requests: dict[str, _DraftState] = {}
        self._expected: dict[str, int] = {}
        """The coming step's most drafts per request (`expect`); None planned: K each."""
        self._planned = False
        self._steps: list[DraftStep] = []
        """The inner engine's steps since `take_steps`."""

    @property
    def num_requests(self) -> int:
        """Requests followed now (started and not finished)."""
        return len(self._requests)

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._requests[request_id] = _DraftState(list(prompt_token_ids), len(prompt_token_ids))

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self._requests.get(request_id)
        if state is None or not token_ids:
            return
        state.token_ids.extend(token_ids)
        state.drafts = None

    def expect(self, limits: Mapping[str, int]) -> None:
        """The next round drafts these requests only, each no further than its limit: a
        round's cost is then the drafts the step can use."""
        self._expected = {request_id: k for request_id, k in limits.items() if k > 0}
        self._planned = True

    def catch_up_tokens(self, request_id: str) -> int:
        """Tokens a round computes for the request before its first draft: those past the
        full blocks its latest round left in the prefix cache, at most what a round of a
        request drafted every step computes (a block and K more). More is paid once (the
        prompt's prefill at its first round, or after steps without drafts), not every
        step: counted whole, it would keep a request from ever starting to draft."""
        state = self._requests.get(request_id)
        if state is None:
            return 0
        steady = self.engine.config.block_size + self.num_speculative_tokens + 1
        return min(len(state.token_ids) - state.num_cached, steady)

    def take_steps(self) -> list[DraftStep]:
        steps, self._steps = self._steps, []
        return steps

    def propose(self, request_id: str, k: int) -> list[int]:
        """At most k of the draft model's greedy tokens after the request's tokens; the
        first call after new tokens drafts for every request that has some (one round)."""
        state = self._requests.get(request_id)
        if state is None or k <= 0:
            return []
        if state.drafts is None:
            self._draft_round(request_id)
        assert state.drafts is not None, "a round drafts for the request that asked"
        return state.drafts[:k]

    def finish_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is None:
            return
        # Rounds end with nothing running; a round cut short by an error may leave some.
        if self.engine.has_request(request_id):
            self.engine.abort([request_id])

    def _draft_round(self, asking: str) -> None:
        """Draft for `asking` and every other request whose tokens changed since its last
        proposal and that is decoding (has output): one batch in the inner engine."""
        started: list[_DraftState] = []
        for request_id, state in self._requests.items():
            if state.drafts is not None:
                continue
            if request_id != asking and len(state.token_ids) == state.num_prompt_tokens:
                continue  # still prefilling in the target: nothing will be asked of it yet
            limit = self.num_speculative_tokens
            if self._planned:
                limit = self._expected.get(request_id, 0)
                if limit == 0 and request_id != asking:
                    continue  # the step will not ask it: drafting it would be wasted
            state.drafts, state.pending = [], []
            if self._add_draft_request(request_id, state, max(limit, 1)):
                started.append(state)
        if not started:
            return
        self.num_rounds += 1
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            deltas = self.engine.step()
            self._steps.append(DraftStep(self.engine.last_step_tokens, time.perf_counter() - start))
            for delta in deltas:
                self._requests[delta.request_id].pending.extend(delta.new_token_ids)
        block_size = self.engine.config.block_size
        for state in started:
            state.num_cached = len(state.token_ids) // block_size * block_size
            state.drafts = _within_vocab(state.pending, self.target_vocab_size)
            state.pending = []

    def _add_draft_request(self, request_id: str, state: _DraftState, limit: int) -> bool:
        """Queue the request's greedy continuation in the inner engine; False when the
        draft engine cannot take it (too long for its context, an id past its vocabulary):
        the request is then verified without drafts."""
        room = self.engine.max_model_len - len(state.token_ids)
        num_tokens = min(limit, self.num_speculative_tokens, room)
        if num_tokens < 1:
            return False
        request = Generate(
            request_id=request_id,
            prompt_token_ids=state.token_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True),
        )
        try:
            self.engine.add_request(request)
        except RequestRejected as exc:
            logger.debug("no drafts for %s: %s", request_id, exc.message)
            return False
        return True


def build_draft_drafter(
    config: SpeculativeConfig, target: DraftTarget, engine_factory: DraftEngineFactory
) -> DraftModelDrafter:
    """The drafter of `--speculative-config` method draft_model for `target`, its draft
    engine built by `engine_factory`."""
    return DraftModelDrafter(config, target, engine_factory)


def _check_same_tokenizer(draft_model: str, target: ModelSource) -> ModelSource:
    """The draft model's files; a ValueError when they are missing or their tokenizer is
    not the target's."""
    try:
        draft = resolve_model(draft_model)
        draft_digest = tokenizer_digest(draft)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--speculative-config: model {draft_model!r}: {exc}") from exc
    target_digest = tokenizer_digest(target)
    if draft_digest != target_digest:
        raise ValueError(
            f"--speculative-config: draft model {draft_model!r} does not share the tokenizer "
            f"of the target model {target.name!r} (tokenizer digests {draft_digest[:12]} and "
            f"{target_digest[:12]}): a draft model's token ids must mean the target's"
        )
    return draft


def _kv_cache_gb(config: SpeculativeConfig, target: DraftTarget, draft: ModelSource) -> float:
    """The draft cache's size: the target's tokens plus each sequence's K drafts and its
    partly filled last block, at the draft model's bytes per block."""
    block_size = target.config.block_size
    num_seqs = target.config.max_num_seqs
    blocks = math.ceil(target.num_kv_tokens / block_size) + num_seqs * (
        math.ceil(config.num_speculative_tokens / block_size) + 1
    )
    kv_dtype = resolve_kv_cache_dtype(target.config.kv_cache_dtype, target.dtype)
    bytes_per_block = model_kv_bytes_per_block(load_config(draft), block_size, kv_dtype)
    return blocks * bytes_per_block / _GIB


def _within_vocab(token_ids: list[int], vocab_size: int) -> list[int]:
    """`token_ids` up to the first one past the target's vocabulary (a padding row of a
    draft model whose vocabulary is padded further)."""
    for index, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            return token_ids[:index]
    return token_ids
