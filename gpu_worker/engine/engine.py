"""The engine: one step = schedule -> execute -> sample / verify -> update.

`Engine` is both the core the ZMQ server drives (`add_request` / `abort` / `step`) and
the offline API for batch inference without HTTP:

    from gpu_worker import Engine
    from shared.sampling import SamplingParams
    engine = Engine(model="SmolLM2-135M-Instruct", device="cpu")
    [completion] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))

A step reads as vLLM v1's: the scheduler's `SchedulerOutput`, the executor's forward
(gpu_worker.engine.executor: one rank or a TP group alike), the sampler's tokens or the
speculator's verification, and `Scheduler.update` with the `ModelRunnerOutput`. With
`--async-scheduling` the update is of the step before: step N+1 is scheduled and launched
while step N's tokens are still on their way to the host (gpu_worker.sampling.
sampled_tokens), its decode rows reading them on the device; a step whose batch needs its
previous tokens on the host runs after them (`_overlaps`).

With `enable_lora`, requests name registered LoRA adapters (`Generate.lora_name`); the
registry (`gpu_worker.lora.manager`) holds them in CPU memory, the runner makes each step's
adapters resident in slots and one forward pass mixes them with base-model rows.

With `speculative_config` (ngram, suffix or a draft model, gpu_worker.engine.draft_model),
the `Speculator` (gpu_worker.engine.speculation) proposes drafts into the decoding
requests before each step is scheduled; the runner returns logits at all 1 + k positions
and verification keeps the accepted head plus one token.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from gpu_worker.core.config import CacheConfig, EngineConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.outputs import ModelRunnerOutput
from gpu_worker.core.scheduler import Scheduler
from gpu_worker.core.sequence import FinishReason, Sequence
from gpu_worker.distributed.group import TPGroup
from gpu_worker.engine.admission import Admission
from gpu_worker.engine.deltas import Completion, request_delta, sampled_logprobs
from gpu_worker.engine.draft_model import DraftTarget, build_draft_drafter
from gpu_worker.engine.executor import start_executor
from gpu_worker.engine.lora_ops import LoRAOpResult, build_lora, load_lora, unload_lora
from gpu_worker.engine.profile_sampling import profile_sampling
from gpu_worker.engine.rank import RankModel, build_runner, load_rank_model
from gpu_worker.engine.speculation import Speculator
from gpu_worker.engine.step_sampling import LaunchedStep, launch_sampling
from gpu_worker.lora.layers import LoRAState
from gpu_worker.lora.manager import LoRARegistry
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.sampling.sampled_tokens import SampledTokenCopy
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from gpu_worker.sampling.structured import StructuredOutputs
from shared.model_card import ModelCard
from shared.model_source import ModelSource, resolve_model
from shared.protocol import Generate, RequestDelta, WorkerStats
from shared.sampling import SamplingParams
from shared.tokenizer_digest import tokenizer_digest

__all__ = ["Completion", "Engine", "LoRAOpResult"]

logger = logging.getLogger(__name__)


@dataclass
class _BuiltRank:
    """What this process builds as its rank (`start_executor`'s `build`)."""

    rank: RankModel
    sampler: Sampler
    runner: ModelRunner
    lora: tuple[LoRARegistry, LoRAState] | None

    @property
    def lora_registry(self) -> LoRARegistry | None:
        return None if self.lora is None else self.lora[0]

    @property
    def vocab_size(self) -> int:
        return self.rank.model_config.vocab_size


class Engine:
    """Continuous-batching engine over a paged KV cache.

    Ownership: the scheduler owns the live requests (`Scheduler.requests`, each a
    `Sequence` carrying its tokens, blocks and sampler state); the executor owns the
    runner, which owns the model, its attention backend and the KV tensors; the sampler
    and structured outputs are stateless across requests. Requests are validated once,
    in `add_request` (gpu_worker.engine.admission).
    """

    def __init__(self, model: str | None = None, device: str = "auto", **engine_args: object):
        if model is not None:
            engine_args["model"] = model
        self.config = config = EngineConfig.from_kwargs(device=device, **engine_args)
        source = resolve_model(config.model, config.served_model_name)
        started = time.perf_counter()

        def build(group: TPGroup) -> _BuiltRank:
            rank = load_rank_model(config, source, group)
            logger.info("loaded %s in %.1fs", source.name, time.perf_counter() - started)
            mc = rank.model_config
            # The sampler first: on CUDA its buffers are part of what the profile measures.
            sampler = Sampler(mc.vocab_size, rank.device, list(mc.eos_token_ids))
            post_forward = profile_sampling(
                sampler, rank.model.compute_logits, mc.vocab_size, config.block_size
            )
            # Before the runner: the KV cache is sized with the slots already allocated.
            lora = build_lora(config, rank)
            return _BuiltRank(
                rank, sampler, build_runner(config, rank, group, post_forward, lora), lora
            )

        self.executor, built = start_executor(config, build)
        self.model, self.model_config = built.rank.model, built.rank.model_config
        self.device, self.dtype = built.rank.device, built.rank.dtype
        self.sampler = built.sampler
        mc = self.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(mc.eos_token_ids)
        self.max_model_len = config.context_limit(mc.max_position_embeddings)
        self.lora: LoRARegistry | None = built.lora_registry
        """The registered adapters; None when LoRA is off."""
        num_blocks = self.runner.kv_caches[0].shape[1]
        self.speculator = self._build_speculator(source, num_blocks)
        """Speculative decoding's drafter, verification and counts; None when it is off."""
        self.kv = KVCacheManager(
            CacheConfig(
                block_size=config.block_size,
                num_blocks=num_blocks,
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
        )
        self.structured = StructuredOutputs(source, mc.vocab_size, self.eos_token_ids)
        self.structured.start_loading()
        self.admission = Admission(
            config, self.scheduler, self.vocab_size, self.lora, self.structured
        )
        self.model_card = self._model_card(source)
        self.async_scheduling = config.async_scheduling and self.executor.takes_device_inputs
        """Whether step N+1 may be launched before step N's tokens reach the host."""
        if config.async_scheduling and not self.async_scheduling:
            logger.info("--async-scheduling: a tensor-parallel group's steps run in order")
        self._token_copy = SampledTokenCopy(self.device)
        self._launched: LaunchedStep | None = None
        """The step whose tokens are on their way (async scheduling only, between steps)."""
        self._num_steps = 0
        self.last_step_tokens = 0
        """Tokens the latest step computed (what a draft model's steps are timed by)."""
        self._offline_ids = itertools.count()

    @property
    def runner(self) -> ModelRunner:
        """This rank's runner (the model, its attention backend, the KV tensors)."""
        return self.executor.runner

    def _build_speculator(self, source: ModelSource, num_blocks: int) -> Speculator | None:
        speculative = self.config.speculative()
        if speculative is None:
            return None
        drafter = None
        if speculative.method == "draft_model":
            target = DraftTarget(
                config=self.config,
                source=source,
                device=self.device,
                dtype=self.dtype,
                vocab_size=self.vocab_size,
                num_kv_tokens=num_blocks * self.config.block_size,
            )
            drafter = build_draft_drafter(speculative, target, Engine)
        return Speculator(speculative, self.sampler, drafter)

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
        """Queue a request under `request_key`; raise RequestRejected if it cannot run."""
        key = request_key or request.request_id
        matcher = self.admission.check(request, key)
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

    def load_lora(self, name: str, path: str) -> LoRAOpResult:
        """Register the adapter at `path`, which must resolve inside --lora-root."""
        return load_lora(self.lora, name, path)

    def unload_lora(self, name: str) -> LoRAOpResult:
        """Forget adapter `name`; refused (409) while requests run or wait under it."""
        return unload_lora(self.lora, name, self.scheduler.requests.values())

    def abort(self, request_keys: list[str]) -> None:
        """Stop these requests and free their KV blocks now; a step in flight sends
        nothing more for them."""
        finished = self.scheduler.finish_requests(request_keys, FinishReason.ABORT)
        if self.speculator is not None:
            for seq in finished:
                self.speculator.finish(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    def has_request(self, request_id: str) -> bool:
        """The request is running or waiting here."""
        return request_id in self.scheduler.requests

    def step(self) -> list[RequestDelta]:
        """Run one engine step; return a delta for every sequence that got a token.

        schedule -> execute -> sample / verify -> update. With async scheduling the
        update is of the previous step, whose tokens reached the host while this one
        was launched; without it, of this step.
        """
        deltas: list[RequestDelta] = []
        previous, self._launched = self._launched, None
        if previous is not None and not self._overlaps(previous):
            deltas, previous = self._update(previous), None
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        output = self.scheduler.schedule()
        self.last_step_tokens = output.num_batched_tokens
        self.sampler.release(output.finished_request_ids)
        run = self.executor.execute(output, None if previous is None else previous.tokens)
        launched = None
        if run is not None:
            launched = launch_sampling(
                output, run, started, self.sampler, self._token_copy, self.speculator
            )
        if previous is not None:
            deltas += self._update(previous)
        if launched is not None:
            self._num_steps += 1
            if self.async_scheduling:
                self._launched = launched
            else:
                deltas += self._update(launched)
        return deltas

    def _overlaps(self, previous: LaunchedStep) -> bool:
        """Whether the next step may be scheduled before `previous`'s update: only when
        no sequence of it needs its tokens on the host to sample or draft its next one."""
        return self.speculator is None and not previous.needs_host_tokens

    def _update(self, step: LaunchedStep) -> list[RequestDelta]:
        """Apply a launched step's tokens (waiting for them to reach the host) and return
        the deltas of the sequences that got some."""
        result = ModelRunnerOutput()
        result.sampled_token_ids.update(
            (request_id, list(tokens)) for request_id, tokens in step.verified.items()
        )
        if step.tokens is not None:
            for item, token_id in zip(step.plain_items, step.tokens.host_ids(), strict=True):
                result.sampled_token_ids[item.seq.request_id] = [token_id]
            result.logprobs = sampled_logprobs(step.plain_items, step.tokens.output)
        output = step.output
        sampling = [item.seq for item in output.scheduled if item.will_sample]
        num_before = {seq.request_id: seq.num_output_tokens for seq in sampling}
        changed = self.scheduler.update(output, result)
        if output.shrunk_request_ids:
            # Their tables lost blocks: the runner rewrites their rows from scratch.
            self.runner.release(output.shrunk_request_ids)
        errors = self._advance_matchers(changed)
        if not changed:
            return []
        num_new = {
            seq.request_id: seq.num_output_tokens - num_before[seq.request_id] for seq in changed
        }
        logprobs = result.logprobs
        if self.speculator is not None:
            logprobs.update(self.speculator.step_done(output, changed, num_new, step.started))
        return [request_delta(seq, num_new[seq.request_id], logprobs, errors) for seq in changed]

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
        """Stop whatever the executor started (idempotent; the other TP ranks)."""
        self.executor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
