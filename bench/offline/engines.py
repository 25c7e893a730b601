"""Engines as the offline benchmarks build, warm and time them: the forward billed to a
timer, a whole workload through `Engine.generate`, one request, and closed-loop clients."""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from bench.common.timing import Clock
from bench.common.workload import Workload
from gpu_worker import Engine
from shared.protocol import Generate
from shared.sampling import SamplingParams


class ForwardTimer:
    """Stands in for the engine's model and sums the time spent in forward + LM head.

    On CUDA the device is synchronized at both ends, so queued kernels are billed to the
    forward rather than to whatever host code happens to wait for them later.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self._model = model
        self._sync: Callable[[], None] = (
            torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        )
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self._sync()
        self.seconds += time.perf_counter() - start
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self._model, *args, **kwargs)

    def compute_logits(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self._model.compute_logits, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def time_forward(engine: Engine) -> ForwardTimer:
    """Bill every forward and LM head call of `engine` to one timer: the model's, and the
    decode graph replays, which bypass runner.model and are forward time too."""
    runner = engine.runner
    timer = ForwardTimer(runner.model, engine.device)
    runner.model = timer  # type: ignore[assignment]  # forwards every other attribute
    graphs = runner.decode_graphs
    if graphs is not None:
        replay = graphs.run
        graphs.run = lambda *a, **kw: timer.timed(replay, *a, **kw)  # type: ignore[method-assign]
    return timer


def make_engine(
    args: argparse.Namespace, dtype: str, max_num_seqs: int, **engine_args: Any
) -> tuple[Engine, ForwardTimer]:
    """An engine on `args.model`, `args.device` and `args.kv_cache_memory_gb`, its forward
    timed, warmed up on prompts outside any workload (then forgotten by the prefix cache)."""
    engine = Engine(
        model=args.model,
        device=args.device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        **engine_args,
    )
    timer = time_forward(engine)
    warm = [[100 + i + 1000 * j for i in range(120)] for j in range(min(max_num_seqs, 4))]
    engine.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.reset_prefix_cache()
    return engine, timer


def run_engine(engine: Engine, timer: ForwardTimer, work: Workload) -> tuple[Clock, float]:
    """Clock of the whole workload and the share of its wall time outside the forward."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    engine.reset_prefix_cache()
    timer.seconds = 0.0
    completions: list[Any] = []
    clock = Clock.measure(lambda: completions.extend(engine.generate(work.prompts, params)))
    got = [len(c.token_ids) for c in completions]
    assert got == work.output_lens, "the engine did not produce the requested lengths"
    return clock, 1.0 - timer.seconds / clock.wall


def decode_one(engine: Engine, prompt: list[int], new_tokens: int) -> None:
    """One greedy request of exactly `new_tokens` tokens (the single-stream case)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], params)


def closed_loop(
    engine: Engine,
    prompts: list[list[int]],
    output_lens: list[int],
    concurrency: int,
    *,
    ignore_eos: bool = True,
) -> tuple[float, list[list[int]]]:
    """Keep `concurrency` requests in flight until every prompt is done; (seconds, outputs).
    Greedy; each request runs to its output length, or to EOS when not `ignore_eos`."""
    ids = itertools.count()
    queue = deque(range(len(prompts)))
    running: dict[str, int] = {}
    outputs: list[list[int]] = [[] for _ in prompts]

    def submit() -> None:
        index = queue.popleft()
        key = f"bench-{next(ids)}"
        running[key] = index
        sampling = SamplingParams(
            temperature=0.0, max_tokens=output_lens[index], ignore_eos=ignore_eos
        )
        request = Generate(request_id=key, prompt_token_ids=prompts[index], sampling=sampling)
        engine.add_request(request, key)

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    while queue and len(running) < concurrency:
        submit()
    while running:
        for delta in engine.step():
            index = running[delta.request_id]
            outputs[index].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                del running[delta.request_id]
                if queue:
                    submit()
    sync()
    seconds = time.perf_counter() - start
    if ignore_eos:
        assert [len(o) for o in outputs] == output_lens, "the engine cut a request short"
    return seconds, outputs
