"""The engine: one step = schedule -> build the batch -> run the model -> sample -> update.

`Engine` is both the core the ZMQ server drives (`add_request` / `abort` / `step`) and
the offline API for batch inference without HTTP:

    from gpu_worker import Engine
    from shared.sampling import SamplingParams
    engine = Engine(model="SmolLM2-135M-Instruct", device="cpu")
    [completion] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))

With `enable_lora`, requests name registered LoRA adapters (`Generate.lora_name`); the
registry (`gpu_worker.lora.manager`) holds them in CPU memory, the runner makes each step's
adapters resident in slots and one forward pass mixes them with base-model rows. Under
tensor parallelism the registry is rank 0's; its slot changes travel with each step.

With `speculative_config` (ngram, suffix or a draft model, gpu_worker.engine.draft_model),
the `Speculator` (gpu_worker.engine.speculation) drafts for decoding requests, which are
scheduled with up to K drafts, as many as pay for their rows
(gpu_worker.spec_decode.draft_length); the runner returns logits at all 1 + k positions and
verification keeps the accepted head plus one token.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from gpu_worker.core.config import CacheConfig, EngineConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from gpu_worker.core.sequence import FinishReason, Sequence
from gpu_worker.distributed.group import TPGroup
from gpu_worker.engine.draft_model import DraftTarget, build_draft_drafter
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.engine.profile_sampling import profile_sampling
from gpu_worker.engine.rank import RankModel, attach_lora_slots, build_runner, load_rank_model
from gpu_worker.engine.speculation import Speculator
from gpu_worker.engine.tp_worker import TPLeader
from gpu_worker.lora.layers import LoRAState
from gpu_worker.lora.manager import LoRAConflictError, LoRARegistry
from gpu_worker.lora.paths import InvalidLoRAError, LoRAError
from gpu_worker.runner.device import resolve_device
from gpu_worker.runner.model_runner import RunnerOutput
from gpu_worker.sampling.prompt_logprobs import record_prompt_logprobs, score_prompt_rows
from gpu_worker.sampling.sampler import Sampler, SamplerOutput, new_sampler_state
from gpu_worker.sampling.structured import RequestMatcher, StructuredOutputs
from gpu_worker.sampling.upload import upload
from gpu_worker.spec_decode.draft_length import DraftLengthController
from shared.constraints import ConstraintError
from shared.model_card import ModelCard
from shared.model_source import ModelSource, resolve_model
from shared.protocol import FinishReason as WireFinishReason
from shared.protocol import Generate, RequestDelta, TokenLogprobs, WorkerStats
from shared.sampling import SamplingParams, SamplingParamsError
from shared.tokenizer_digest import tokenizer_digest

logger = logging.getLogger(__name__)

_WIRE_FINISH: dict[FinishReason, WireFinishReason] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


@dataclass
class Completion:
    """One prompt's result from `Engine.generate`."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    stop_token_id: int | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        """Fold in one step's delta of this prompt."""
        self.token_ids.extend(delta.new_token_ids)
        if delta.logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_token_id = delta.stop_token_id


@dataclass(frozen=True)
class LoRAOpResult:
    """How `Engine.load_lora` or `unload_lora` went: an HTTP-style status (200 done, 400
    invalid or refused, 404 not found, 409 already loaded or in use) and what to tell."""

    status: int
    message: str

    @property
    def ok(self) -> bool:
        return self.status == 200


class Engine:
    """Continuous-batching engine over a paged KV cache.

    Ownership: the scheduler owns the live requests (`Scheduler.requests`, each a
    `Sequence` carrying its tokens, blocks and sampler state); the runner owns the model,
    its attention backend and the KV tensors; the sampler and structured outputs are
    stateless across requests. Requests are validated once, here in `add_request`.
    """

    def __init__(self, model: str | None = None, device: str = "auto", **engine_args: object):
        if model is not None:
            engine_args["model"] = model
        self.config = config = EngineConfig.from_kwargs(device=device, **engine_args)
        source = resolve_model(config.model, config.served_model_name)
        started = time.perf_counter()
        # With tensor parallelism this process is rank 0: it starts the node's other ranks,
        # which build their shards as it builds its own (`gpu_worker.engine.rank`).
        self._tp: TPLeader | None = None
        self._tp_released: list[str] = []
        if config.tensor_parallel_size > 1:
            self._tp = TPLeader(config)
            atexit.register(self.close)
            group = self._tp.group
        else:
            group = TPGroup.single(resolve_device(config.device))
        with self._tp.starting() if self._tp is not None else contextlib.nullcontext():
            rank = load_rank_model(config, source, group)
            logger.info("loaded %s in %.1fs", source.name, time.perf_counter() - started)
            self.model, self.model_config = rank.model, rank.model_config
            self.device, self.dtype = rank.device, rank.dtype
            mc = self.model_config
            self.vocab_size = mc.vocab_size
            self.eos_token_ids = list(mc.eos_token_ids)
            self.max_model_len = config.context_limit(mc.max_position_embeddings)
            # The sampler first: on CUDA its buffers are part of what the profile measures.
            self.sampler = Sampler(mc.vocab_size, self.device, self.eos_token_ids)
            post_forward = profile_sampling(
                self.sampler, self.model.compute_logits, self.vocab_size, config.block_size
            )
            # Before the runner: the KV cache is sized with the slots already allocated.
            lora = self._build_lora(rank)
            self.runner = build_runner(config, rank, group, post_forward, lora)
        if self._tp is not None:
            self._tp.started()
        self.lora: LoRARegistry | None = None if lora is None else lora[0]
        """The registered adapters; None when LoRA is off."""
        speculative = config.speculative()
        self.speculator = None
        if speculative is not None:
            drafter = None
            if speculative.method == "draft_model":
                target = DraftTarget(
                    config=config,
                    source=source,
                    device=self.device,
                    dtype=self.dtype,
                    vocab_size=mc.vocab_size,
                    num_kv_tokens=self.runner.kv_caches[0].shape[1] * config.block_size,
                )
                drafter = build_draft_drafter(speculative, target)
            self.speculator = Speculator(speculative, self.sampler, drafter)
        """Speculative decoding's drafter, verification and counts; None when it is off."""
        self.draft_length = (
            DraftLengthController(speculative.num_speculative_tokens)
            if speculative is not None and speculative.draft_length == "adaptive"
            else None
        )
        """How many drafts pay for their rows, request by request; None without speculation
        or with a fixed draft length."""
        self._draft_limits: dict[str, int] = {}
        """The draft-length controller's plan for the step being scheduled."""
        self.kv = KVCacheManager(
            CacheConfig(
                block_size=config.block_size,
                num_blocks=self.runner.kv_caches[0].shape[1],
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                scheduling_policy=config.scheduling_policy,
                max_loras=config.max_loras if config.enable_lora else None,
            ),
            self.kv,
            self.eos_token_ids,
            propose=None if self.speculator is None else self._propose,
        )
        self.structured = StructuredOutputs(source, mc.vocab_size, self.eos_token_ids)
        self.structured.start_loading()
        self.model_card = self._model_card(source)
        self._num_steps = 0
        self.last_step_tokens = 0
        """Tokens the latest step computed (what a draft model's steps are timed by)."""
        self._offline_ids = itertools.count()

    def _build_lora(self, rank: RankModel) -> tuple[LoRARegistry, LoRAState] | None:
        """The LoRA slots wrapped into the model and the registry over them, holding the
        --lora-modules (a bad one fails the start); None when LoRA is off."""
        attached = attach_lora_slots(self.config, rank)
        if attached is None:
            return None
        slots, state = attached
        registry = LoRARegistry(slots, rank.model_config, self.config.lora_root)
        for name, path in self.config.lora_module_paths().items():
            try:
                registry.register_trusted(name, path)
            except LoRAError as exc:  # a ValueError, as every bad engine argument is
                raise ValueError(f"--lora-modules {name}: {exc.message}") from exc
        return registry, state

    def _model_card(self, source: ModelSource) -> ModelCard:
        mc = self.model_config
        lora_on = self.config.enable_lora
        return ModelCard(
            model_id=source.name,
            tokenizer_digest=tokenizer_digest(source),
            vocab_size=mc.vocab_size,
            eos_token_ids=self.eos_token_ids,
            bos_token_id=mc.bos_token_id,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            architecture=mc.architecture,
            dtype=str(self.dtype).removeprefix("torch."),
            scheduling_policy=self.config.scheduling_policy,
            max_loras=self.config.max_loras if lora_on else 0,
            max_lora_rank=self.config.max_lora_rank if lora_on else 0,
        )

    # ---- the core the server drives ------------------------------------------------

    def add_request(self, request: Generate, request_key: str | None = None) -> None:
        """Queue a request under `request_key`; raise RequestRejected if it cannot run.

        The one place a request is checked: the scheduler and the sampler trust it after.
        """
        key = request_key or request.request_id
        matcher = self._validate(request, key)
        seq = Sequence(
            request_id=key,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            priority=request.priority,
            block_size=self.config.block_size,
            sampler_state=new_sampler_state(request.sampling, matcher),
        )
        self.scheduler.add(seq)
        if self.speculator is not None:
            self.speculator.start(seq)

    def _validate(self, request: Generate, key: str) -> RequestMatcher | None:
        """Raise RequestRejected if the request cannot run here; return its grammar matcher
        when it has a constraint."""
        if key in self.scheduler.requests:
            raise RequestRejected("duplicate", f"request {request.request_id!r} is running")
        prompt = request.prompt_token_ids
        if max(prompt, default=0) >= self.vocab_size:
            raise RequestRejected(
                "invalid_request",
                f"prompt_token_ids hold an id outside the vocabulary [0, {self.vocab_size})",
            )
        try:
            request.sampling.validate(self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestRejected("invalid_request", exc.message) from exc
        if request.lora_name is not None:
            if self.lora is None:
                raise RequestRejected(
                    "lora_disabled",
                    f"the request names LoRA adapter {request.lora_name!r} but this worker "
                    "runs without --enable-lora",
                )
            if request.lora_name not in self.lora:
                raise RequestRejected(
                    "lora_not_found", f"no LoRA adapter named {request.lora_name!r} is loaded"
                )
        if request.priority != 0 and self.config.scheduling_policy == "fcfs":
            raise RequestRejected(
                "invalid_request",
                "priority is not honoured by this worker (--scheduling-policy fcfs): send 0",
            )
        reason = self.scheduler.check_admissible(len(prompt), request.sampling.max_tokens)
        if reason is not None:
            # An empty prompt is malformed rather than too long; the wire forbids it too.
            raise RequestRejected("too_long" if prompt else "invalid_request", reason)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise RequestRejected("queue_full", "the worker's queue is full")
        if request.constraint is None:
            return None
        try:  # the render tier checked it; a worker re-checks
            return self.structured.new_matcher(request.constraint, prompt)
        except ConstraintError as exc:
            raise RequestRejected("invalid_request", f"constraint: {exc.message}") from exc

    def load_lora(self, name: str, path: str) -> LoRAOpResult:
        """Register the adapter at `path`, which must resolve inside --lora-root."""
        try:
            self._registry().register_runtime(name, path)
        except LoRAError as exc:
            return LoRAOpResult(exc.status, exc.message)
        logger.info("registered LoRA adapter %s", name)
        return LoRAOpResult(200, f"LoRA adapter {name!r} added")

    def unload_lora(self, name: str) -> LoRAOpResult:
        """Forget adapter `name`; refused (409) while requests run or wait under it, whose
        next step would find no adapter."""
        try:
            registry = self._registry()
            in_use = sum(seq.lora_name == name for seq in self.scheduler.requests.values())
            if in_use:
                raise LoRAConflictError(
                    f"LoRA adapter {name!r} is in use by {in_use} request(s): "
                    "unload it after they end"
                )
            registry.unregister(name)
        except LoRAError as exc:
            return LoRAOpResult(exc.status, exc.message)
        logger.info("unregistered LoRA adapter %s", name)
        return LoRAOpResult(200, f"LoRA adapter {name!r} removed")

    def _registry(self) -> LoRARegistry:
        if self.lora is None:
            raise InvalidLoRAError("LoRA is off: start the worker with --enable-lora")
        return self.lora

    def abort(self, request_keys: list[str]) -> None:
        """Stop these requests and free their KV blocks now."""
        finished = self.scheduler.finish_requests(request_keys, FinishReason.ABORT)
        if self.speculator is not None:
            for seq in finished:
                self._finish_speculation(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        """Run one engine step; return a delta for every sequence that got a token."""
        start = time.perf_counter()
        if self.draft_length is not None:
            self._plan_drafts()
        output = self.scheduler.schedule()
        self.last_step_tokens = output.num_batched_tokens
        self.sampler.release(output.finished_request_ids)
        # Under TP the forward and the prompt scoring's gathers are collectives: rank 0's
        # idle messages to its followers wait for them.
        with self._tp.leading() if self._tp is not None else contextlib.nullcontext():
            run = self._forward(output)
            if run is None:
                return []
            if run.prompt_hidden is not None:
                self._score_prompts(output.scheduled, run.prompt_hidden)
        logits = run.logits
        sampling_items = [item for item in output.scheduled if item.will_sample]
        plain_items, sampled, result, verified = self._sample(logits, sampling_items)
        num_before = {item.seq.request_id: item.seq.num_output_tokens for item in sampling_items}
        changed = self.scheduler.update(output, sampled, verified)
        if output.shrunk_request_ids:
            # Their tables lost blocks: the runner rewrites their rows from scratch.
            self.runner.release(output.shrunk_request_ids)
        errors = self._advance_matchers(changed)
        self._num_steps += 1
        if not changed:
            return []
        num_new = {
            seq.request_id: seq.num_output_tokens - num_before[seq.request_id] for seq in changed
        }
        logprobs = self._logprobs(plain_items, result) if result is not None else {}
        if self.speculator is not None:
            logprobs.update(self._speculation_kept(changed, num_new, output.scheduled, start))
        return [self._delta(seq, num_new[seq.request_id], logprobs, errors) for seq in changed]

    def _forward(self, output: SchedulerOutput) -> RunnerOutput | None:
        """Release what finished and run the scheduled batch; None when nothing is."""
        if self._tp is not None:
            # The followers release with the next step they run, whichever step that is.
            self._tp_released.extend(output.finished_request_ids)
            if output.is_empty:
                return None
            released, self._tp_released = self._tp_released, []
            return self._tp.step(self.runner, output.scheduled, released, self.lora)
        # Before this step's rows are laid out: an id that left may be back as a new request.
        self.runner.release(output.finished_request_ids)
        if output.is_empty:
            return None
        return self.runner.execute(output.scheduled)

    def _sample(
        self, logits: torch.Tensor, items: list[ScheduledSequence]
    ) -> tuple[
        list[ScheduledSequence], dict[str, int], SamplerOutput | None, dict[str, list[int]] | None
    ]:
        """Sample the items without drafts (one logits row each) and verify the ones with
        (k + 1 rows each, in batch order): the plain items, their tokens and the sampler's
        output, and the tokens each drafted item keeps (None without drafts)."""
        plain_items: list[ScheduledSequence] = []
        plain_rows: list[int] = []
        drafted_items: list[ScheduledSequence] = []
        drafted_rows: list[int] = []
        row = 0
        for item in items:
            width = 1 + len(item.draft_token_ids)
            if width > 1:
                drafted_items.append(item)
                drafted_rows.extend(range(row, row + width))
            else:
                plain_items.append(item)
                plain_rows.append(row)
            row += width
        sampled: dict[str, int] = {}
        result: SamplerOutput | None = None
        if plain_items:
            plain_logits = logits
            if drafted_items:
                plain_logits = logits.index_select(0, upload(plain_rows, torch.long, logits.device))
            result = self.sampler.sample(plain_logits, [item.seq for item in plain_items])
            for item, token_id in zip(plain_items, result.token_ids, strict=True):
                sampled[item.seq.request_id] = token_id
        verified = None
        if drafted_items:
            assert self.speculator is not None, "only a speculator drafts"
            verified = self.speculator.verify(logits, drafted_rows, drafted_items)
            if self.draft_length is not None:
                for item in drafted_items:
                    num_kept = len(verified[item.seq.request_id])
                    self.draft_length.verified(
                        item.seq.request_id, len(item.draft_token_ids), num_kept - 1
                    )
        return plain_items, sampled, result, verified

    def _speculation_kept(
        self,
        changed: list[Sequence],
        num_new: dict[str, int],
        scheduled: list[ScheduledSequence],
        start: float,
    ) -> dict[str, list[TokenLogprobs]]:
        """After a step: the drafter learns what each request kept (and lets finished ones
        go), the draft-length controller what the step cost; the verified requests'
        logprobs."""
        assert self.speculator is not None
        for seq in changed:
            self.speculator.kept(seq, num_new[seq.request_id])
            if seq.is_finished and self.draft_length is not None:
                self.draft_length.finish(seq.request_id)  # its drafter went in `kept`
        if self.draft_length is not None:
            self._time_decode_step(scheduled, start)
        return self.speculator.kept_logprobs(num_new)

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's drafts for a decoding `seq`: the drafter's, no more than the
        draft-length controller finds worth their rows."""
        assert self.speculator is not None
        if self.draft_length is None:
            return self.speculator.propose(seq, room)
        limit = min(self._draft_limits.get(seq.request_id, 0), room)
        return self.speculator.propose(seq, limit) if limit > 0 else []

    def _plan_drafts(self) -> None:
        """Before scheduling: each decoding request's most drafts this step, from the
        draft-length controller, told to the drafter too (a draft model drafts no more)."""
        assert self.speculator is not None and self.draft_length is not None
        running = self.scheduler.running
        decoding = [s.request_id for s in running if s.num_computed_tokens == s.num_tokens - 1]
        self._draft_limits = self.draft_length.plan(
            decoding, len(running) - len(decoding), self.speculator.drafter.catch_up_tokens
        )
        self.speculator.expect(self._draft_limits)

    def _time_decode_step(self, scheduled: list[ScheduledSequence], start: float) -> None:
        """Tell the draft-length controller what a step of decodes only cost, end to end,
        and what the drafter's model ran in it; a step with prefill rows says nothing
        about a decode row's cost."""
        assert self.draft_length is not None and self.speculator is not None
        drafting = self.speculator.drafter.take_steps()
        if scheduled and all(
            item.will_sample and item.num_new_tokens == 1 + len(item.draft_token_ids)
            for item in scheduled
        ):
            rows = sum(item.num_new_tokens for item in scheduled)
            self.draft_length.step_timed(rows, time.perf_counter() - start, drafting)
        else:
            self.draft_length.drafted(drafting)

    def _finish_speculation(self, request_id: str) -> None:
        assert self.speculator is not None
        self.speculator.finish(request_id)
        if self.draft_length is not None:
            self.draft_length.finish(request_id)

    @staticmethod
    def _delta(
        seq: Sequence,
        num_new: int,
        logprobs: dict[str, list[TokenLogprobs]],
        errors: dict[str, str],
    ) -> RequestDelta:
        """The wire delta of a sequence that got `num_new` tokens this step."""
        error = errors.get(seq.request_id)
        finish = _WIRE_FINISH[seq.finish_reason] if seq.finish_reason is not None else None
        # Gathered while the prompt ran; the first delta (this one, when set) takes them.
        state = seq.sampler_state
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=seq.output_token_ids[-num_new:],
            finish_reason="error" if error is not None else finish,
            stop_token_id=seq.stop_token_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs.get(seq.request_id),
            error=error,
            # Only the first delta carries it: the render tier records it once per request.
            queue_time=seq.queue_time if seq.num_output_tokens == num_new else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _score_prompts(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """Score this step's prompt-logprob rows (the runner's `prompt_hidden`, in batch
        order) and keep each sequence's until its first delta."""
        items = [(item, item.prompt_logprob_positions) for item in scheduled]
        items = [(item, positions) for item, positions in items if positions]
        targets: list[int] = []
        num_top: list[int] = []
        for item, positions in items:
            targets.extend(item.seq.all_token_ids[positions.start + 1 : positions.stop + 1])
            num_top.extend([item.seq.sampling.prompt_logprobs or 0] * len(positions))
        entries = score_prompt_rows(
            hidden, targets, num_top, self.runner.compute_logits, self.vocab_size
        )
        start = 0
        for item, positions in items:
            gathered = item.seq.sampler_state.prompt_logprobs
            assert gathered is not None, "new_sampler_state starts it for such requests"
            record_prompt_logprobs(
                gathered, positions.start, entries[start : start + len(positions)]
            )
            start += len(positions)

    def _advance_matchers(self, changed: list[Sequence]) -> dict[str, str]:
        """Feed each constrained sequence's new token to its matcher; end the ones whose
        grammar is complete with "stop". Returns the errors of matchers that failed."""
        errors: dict[str, str] = {}
        for seq in changed:
            matcher = seq.sampler_state.matcher
            if matcher is None:
                continue
            matcher.sync(seq.output_token_ids)
            if seq.is_finished or not matcher.is_stopped:
                continue
            # Only EOS could follow: stop now rather than spend a step sampling it.
            self.scheduler.finish_requests([seq.request_id], FinishReason.STOP)
            if matcher.error is not None:
                logger.warning("request %s: constraint failed: %s", seq.request_id, matcher.error)
                errors[seq.request_id] = f"constraint: {matcher.error}"[:4096]
        return errors

    @staticmethod
    def _logprobs(
        items: list[ScheduledSequence], result: SamplerOutput
    ) -> dict[str, list[TokenLogprobs]]:
        if result.logprobs is None:
            return {}
        sampled = result.logprobs.tolist()
        ranks = result.ranks.tolist() if result.ranks is not None else [0] * len(sampled)
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        out: dict[str, list[TokenLogprobs]] = {}
        for row, item in enumerate(items):
            if item.seq.sampling.logprobs is None:
                continue
            k = result.num_top[row]
            out[item.seq.request_id] = [
                TokenLogprobs(
                    logprob=sampled[row],
                    rank=int(ranks[row]),
                    top_token_ids=top_ids[row][:k] if top_ids is not None else [],
                    top_logprobs=top_lps[row][:k] if top_lps is not None else [],
                )
            ]
        return out

    def stats(self) -> WorkerStats:
        """Load and cache numbers for heartbeats."""
        prefix = self.kv.stats
        lora = self.lora
        spec = self.speculator
        return WorkerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            steps=self._num_steps,
            lora_registered=lora.registered if lora is not None else [],
            lora_resident=lora.resident if lora is not None else [],
            lora_loads=lora.slots.num_loads if lora is not None else 0,
            lora_evictions=lora.slots.num_evictions if lora is not None else 0,
            spec_num_draft_tokens=0 if spec is None else spec.num_draft_tokens,
            spec_num_accepted_tokens=0 if spec is None else spec.num_accepted_tokens,
            spec_method=None if spec is None else spec.method,
            spec_num_drafts=0 if spec is None else spec.num_drafts,
            spec_accepted_per_position=[] if spec is None else list(spec.accepted_per_position),
        )

    # ---- offline API ---------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_names: list[str | None] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt in one continuous batch; results in prompt order.
        `lora_names` gives each prompt's adapter (None: the base model)."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if lora_names is None:
            lora_names = [None] * len(prompts)
        if len(lora_names) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_names)} lora_names")
        keys = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        results: dict[str, Completion] = {}
        for key, prompt, sampling, lora_name in zip(keys, prompts, params, lora_names, strict=True):
            results[key] = Completion([], "", [] if sampling.logprobs is not None else None, 0)
            request = Generate(
                request_id=key, prompt_token_ids=prompt, sampling=sampling, lora_name=lora_name
            )
            self.add_request(request, key)
        while self.has_unfinished_requests():
            for delta in self.step():
                completion = results.get(delta.request_id)
                if completion is not None:
                    completion.add(delta)
        return [results[key] for key in keys]

    @torch.inference_mode()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    # ---- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; nothing to do at TP=1)."""
        if self._tp is not None:
            self._tp.close()
            # atexit's reference would keep a closed engine's model alive until exit.
            atexit.unregister(self.close)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
