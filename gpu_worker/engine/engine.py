"""The engine: one step = schedule -> build the batch -> run the model -> sample -> update.

`Engine` is both the core the ZMQ server drives (`add_request` / `abort` / `step`) and
the offline API for batch inference without HTTP:

    from gpu_worker import Engine
    from shared.sampling import SamplingParams
    engine = Engine(model="SmolLM2-135M-Instruct", device="cpu")
    [completion] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from gpu_worker.attention.torch_backend import allocate_kv_caches, get_attention_backend
from gpu_worker.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.engine.kv_cache import KVCacheManager
from gpu_worker.engine.scheduler import Scheduler
from gpu_worker.engine.sequence import FinishReason, Sequence
from gpu_worker.loader import load_model
from gpu_worker.ops.layer_ops import get_layer_ops
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner
from gpu_worker.runner.device import (
    kv_cache_bytes_per_block,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
)
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.sampling.sampler import Sampler, SamplerOutput, SamplingRequestState
from gpu_worker.sampling.structured import StructuredOutputs
from shared.constraints import ConstraintError
from shared.model_card import ModelCard
from shared.model_source import resolve_model
from shared.protocol import Generate, RequestDelta, TokenLogprobs, WorkerStats
from shared.sampling import SamplingParams, SamplingParamsError
from shared.tokenizer_digest import tokenizer_digest

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GB = 1.0


@dataclass
class Completion:
    """One prompt's result from `Engine.generate`."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    stop_token_id: int | None = None


class Engine:
    """Continuous-batching engine over a paged KV cache."""

    def __init__(self, model: str | None = None, device: str = "auto", **engine_args: object):
        if model is not None:
            engine_args["model"] = model
        self.config = config = EngineConfig.from_kwargs(device=device, **engine_args)
        source = resolve_model(config.model, config.served_model_name)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        started = time.perf_counter()
        self.model, self.model_config = load_model(
            source,
            self.device,
            self.dtype,
            get_attention_backend(backend_name),
            layer_ops=get_layer_ops(backend_name),
            gguf_kernels=config.cpu_gguf_kernels,
        )
        mc = self.model_config
        logger.info("loaded %s in %.1fs", source.name, time.perf_counter() - started)

        max_model_len = config.max_model_len or mc.max_position_embeddings
        if mc.sliding_window is not None:
            max_model_len = min(max_model_len, mc.sliding_window)
        kv_gb = config.kv_cache_memory_gb
        if kv_gb is None and self.device.type != "cuda":
            kv_gb = CPU_DEFAULT_KV_CACHE_GB
        per_block = kv_cache_bytes_per_block(
            mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        num_blocks = num_kv_blocks(
            self.device,
            per_block,
            kv_cache_memory_gb=kv_gb,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        kv_caches = allocate_kv_caches(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.kv = KVCacheManager(
            CacheConfig(
                block_size=config.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        self.eos_token_ids = list(mc.eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
            ),
            self.kv,
            self.eos_token_ids,
        )
        self.runner = ModelRunner(self.model, kv_caches, config.block_size, self.device)
        self.runner.decode_graphs = self._decode_graphs(backend_name, kv_caches, max_model_len)
        self.sampler = Sampler(mc.vocab_size, self.device, self.eos_token_ids)
        self.structured = StructuredOutputs(source, mc.vocab_size, self.eos_token_ids)
        self.structured.start_loading()
        self.vocab_size = mc.vocab_size
        self.max_model_len = max_model_len
        self.model_card = ModelCard(
            model_id=source.name,
            tokenizer_digest=tokenizer_digest(source),
            vocab_size=mc.vocab_size,
            eos_token_ids=self.eos_token_ids,
            bos_token_id=mc.bos_token_id,
            max_model_len=max_model_len,
            block_size=config.block_size,
            architecture=mc.architecture,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        self._states: dict[str, SamplingRequestState] = {}
        self._num_steps = 0
        self._offline_ids = itertools.count()

    def _decode_graphs(
        self, backend_name: str, kv_caches: list[torch.Tensor], max_model_len: int
    ) -> DecodeGraphRunner | None:
        """Capture the decode graphs where they apply: CUDA, the Triton backend (the torch
        backend plans each step on the host), and not `enforce_eager`."""
        config = self.config
        if self.device.type != "cuda" or backend_name != "triton" or config.enforce_eager:
            return None
        max_batch = config.cuda_graph_max_batch_size or min(config.max_num_seqs, 512)
        if max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be positive, got {max_batch}")
        graphs = DecodeGraphRunner(
            self.model,
            kv_caches,
            max_batch_size=min(max_batch, config.max_num_seqs),
            max_blocks_per_seq=-(-max_model_len // config.block_size),
            block_size=config.block_size,
            device=self.device,
            capture=True,
        )
        graphs.capture_all()
        return graphs

    # ---- the core the server drives ------------------------------------------------

    def add_request(self, request: Generate, request_key: str | None = None) -> None:
        """Queue a request under `request_key`; raise RequestRejected if it cannot run."""
        key = request_key or request.request_id
        if key in self._states:
            raise RequestRejected("duplicate", f"request {request.request_id!r} is running")
        if max(request.prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(
                "invalid_request",
                f"prompt_token_ids hold an id outside the vocabulary [0, {self.vocab_size})",
            )
        try:
            request.sampling.validate(self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestRejected("invalid_request", exc.message) from exc
        reason = self.scheduler.check_admissible(
            len(request.prompt_token_ids), request.sampling.max_tokens
        )
        if reason is not None:
            raise RequestRejected("too_long", reason)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise RequestRejected("queue_full", "the worker's queue is full")
        matcher = None
        if request.constraint is not None:  # the render tier checked it; a worker re-checks
            try:
                matcher = self.structured.new_matcher(request.constraint, request.prompt_token_ids)
            except ConstraintError as exc:
                raise RequestRejected("invalid_request", f"constraint: {exc.message}") from exc
        seq = Sequence(
            request_id=key,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            priority=request.priority,
            arrival_time=request.arrival_time or time.time(),
            block_size=self.config.block_size,
        )
        state = SamplingRequestState.create(request.sampling, seq.prompt_token_ids, self.device)
        # The sampler reads penalties from the same list the scheduler appends to.
        state.output_token_ids = seq.output_token_ids
        state.matcher = matcher
        self.scheduler.add(seq)
        self._states[key] = state

    def abort(self, request_keys: list[str]) -> None:
        """Stop these requests and free their KV blocks now."""
        for seq in self.scheduler.abort(request_keys):
            self._states.pop(seq.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        """Run one engine step; return a delta for every sequence that got a token."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        logits = self.runner.execute(output.scheduled)
        sampling_items = [item for item in output.scheduled if item.will_sample]
        sampled: dict[str, int] = {}
        result: SamplerOutput | None = None
        if sampling_items:
            states = [self._states[item.seq.request_id] for item in sampling_items]
            result = self.sampler.sample(logits, states)
            for item, token_id in zip(sampling_items, result.token_ids, strict=True):
                sampled[item.seq.request_id] = token_id
        changed = self.scheduler.update(output, sampled)
        errors = self._advance_matchers(changed)
        self._num_steps += 1
        if not changed:
            return []
        logprobs = self._logprobs(sampling_items, result) if result is not None else {}
        deltas: list[RequestDelta] = []
        for seq in changed:
            finish = seq.finish_reason.value if seq.finish_reason is not None else None
            error = errors.get(seq.request_id)
            deltas.append(
                RequestDelta(
                    request_id=seq.request_id,
                    new_token_ids=[seq.output_token_ids[-1]],
                    finish_reason="error" if error is not None else finish,
                    stop_token_id=seq.stop_token_id,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    logprobs=logprobs.get(seq.request_id),
                    error=error,
                )
            )
            if finish is not None:
                self._states.pop(seq.request_id, None)
        return deltas

    def _advance_matchers(self, changed: list[Sequence]) -> dict[str, str]:
        """Feed each constrained sequence's new token to its matcher; end the ones whose
        grammar is complete with "stop". Returns the errors of matchers that failed."""
        errors: dict[str, str] = {}
        for seq in changed:
            state = self._states.get(seq.request_id)
            if state is None or state.matcher is None:
                continue
            state.matcher.sync(seq.output_token_ids)
            if seq.is_finished or not state.matcher.is_stopped:
                continue
            # Only EOS could follow: stop now rather than spend a step sampling it. Abort is
            # the scheduler's "end it and free its blocks now"; the reason is then restated.
            self.scheduler.abort([seq.request_id])
            seq.finish(FinishReason.STOP)
            error = state.matcher.error
            if error is not None:
                logger.warning("request %s: constraint failed: %s", seq.request_id, error)
                errors[seq.request_id] = f"constraint: {error}"[:4096]
        return errors

    @staticmethod
    def _logprobs(items: list, result: SamplerOutput) -> dict[str, list[TokenLogprobs]]:
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
        return WorkerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            steps=self._num_steps,
        )

    # ---- offline API ---------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt in one continuous batch; results in prompt order."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        keys = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        results: dict[str, Completion] = {}
        for key, prompt, sampling in zip(keys, prompts, params, strict=True):
            results[key] = Completion([], "", [] if sampling.logprobs is not None else None, 0)
            self.add_request(
                Generate(request_id=key, prompt_token_ids=prompt, sampling=sampling), key
            )
        while self.has_unfinished_requests():
            for delta in self.step():
                completion = results.get(delta.request_id)
                if completion is None:
                    continue
                completion.token_ids.extend(delta.new_token_ids)
                if delta.logprobs is not None and completion.logprobs is not None:
                    completion.logprobs.extend(delta.logprobs)
                completion.num_cached_tokens = delta.num_cached_tokens
                if delta.finish_reason is not None:
                    completion.finish_reason = delta.finish_reason
                    completion.stop_token_id = delta.stop_token_id
        return [results[key] for key in keys]

    @torch.inference_mode()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
