"""How much host work async scheduling hides, on a CPU, with a device stand-in.

A CPU runs torch ops as the host calls them, so nothing overlaps there by itself. The
stand-in makes the device a timer, as a GPU is to the host: each step's model work
(`runner.model` and the LM head) returns at once, with logits whose argmax is a fixed
token (the sampler's decisions and its Python run as usual, its arithmetic on 64
columns), and the step's sampled ids are readable only once the "device" has run the step
for `device_ms`, counted from when it was launched or from when the step before it ended,
whichever is later. Reading them is the host's only wait (`SampledTokens.host_ids`, a
spin, as CUDA's). Everything else is the engine's real host work: scheduling, the batch
layout and its upload, the sampler, the update and the deltas.

A run puts `batch` requests through their prefill, then times `steps` decode steps of all
of them at once. The device is busy `steps x device_ms` of that; the rest of the wall time
is host work the device waited for: the share this reports. Off, it is the whole host
step (H / (H + D)); on, only what does not fit beside the device's step. `device_ms`
defaults to the host's own step time with async off, measured first: the H200's decode
step at batch 256 is half host work (bench/RESULTS.md, kernels-engine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bench.common.machine import load_average, machine_line
from bench.common.results_md import command_line, write_section
from gpu_worker import Engine
from gpu_worker.sampling.sampled_tokens import SampledTokenCopy, SampledTokens
from gpu_worker.sampling.sampler import SamplerOutput
from shared.protocol import Generate
from shared.sampling import SamplingParams

STAND_IN_COLUMNS = 64


class _InstantModel:
    """The model with its forward and LM head gone: the device's work is the timer's."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], STAND_IN_COLUMNS)
        logits[:, 7] = 1.0
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@dataclass
class _DeviceClock:
    """When the stand-in device is free again."""

    device_s: float
    free_at: float = 0.0

    def launch(self) -> float:
        """A step launched now: when its results are ready."""
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
        return self.free_at


class _TimedTokens(SampledTokens):
    ready_at: float = 0.0

    def host_ids(self) -> list[int]:
        # A spin, as CUDA's event synchronize spins by default: a sleeping host would give
        # its core away and come back late on a busy machine, billed as host work.
        while time.perf_counter() < self.ready_at:
            pass
        return super().host_ids()


class _TimedTokenCopy(SampledTokenCopy):
    def __init__(self, clock: _DeviceClock) -> None:
        super().__init__(torch.device("cpu"))
        self.clock = clock

    def start(self, output: SamplerOutput, row_of: Mapping[str, int]) -> SampledTokens:
        started = super().start(output, row_of)
        timed = _TimedTokens(
            started.device_ids, started.row_of, started.output, started._host, None
        )
        timed.ready_at = self.clock.launch()
        return timed


@dataclass(frozen=True)
class OverlapRun:
    async_scheduling: bool
    step_ms: float
    device_ms: float

    @property
    def host_share(self) -> float:
        """Of a step, the host work the device waited for."""
        return max(0.0, self.step_ms - self.device_ms) / self.step_ms


def stand_in_engine(args: argparse.Namespace, async_scheduling: bool) -> Engine:
    engine = Engine(
        model=args.model,
        device="cpu",
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * 16),
        kv_cache_memory_gb=1.0,
        async_scheduling=async_scheduling,
    )
    engine.runner.model = _InstantModel(engine.runner.model)  # type: ignore[assignment]
    return engine


def timed_decode(engine: Engine, batch: int, steps: int, device_ms: float) -> float:
    """Milliseconds per decode step of `batch` requests, over `steps` steps."""
    clock = _DeviceClock(device_ms / 1000)
    engine._token_copy = _TimedTokenCopy(clock)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = [(13 * i + j) % 40000 + 10 for j in range(16)]
        engine.add_request(
            Generate(request_id=request_id, prompt_token_ids=prompt, sampling=params)
        )
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # every request decodes from here
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed * 1000 / steps


def run_async_overlap(args: argparse.Namespace) -> None:
    modes = [mode == "on" for mode in args.async_scheduling]
    engines = {mode: stand_in_engine(args, mode) for mode in set(modes) | {False}}
    device_ms = args.device_ms
    if device_ms is None:
        timed_decode(engines[False], args.batch, 4, 0.0)  # warm
        device_ms = statistics.median(
            timed_decode(engines[False], args.batch, args.steps, 0.0) for _ in range(3)
        )
    print(f"device step: {device_ms:.2f} ms", flush=True)
    runs: dict[bool, list[OverlapRun]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            step_ms = timed_decode(engines[mode], args.batch, args.steps, device_ms)
            runs[mode].append(OverlapRun(mode, step_ms, device_ms))
            print(f"async {'on' if mode else 'off'}: {step_ms:.2f} ms/step", flush=True)
    rows = []
    for mode in modes:
        step_ms = statistics.median(r.step_ms for r in runs[mode])
        run = OverlapRun(mode, step_ms, device_ms)
        rows.append(
            f"| {'on' if mode else 'off'} | {step_ms:.2f} | {device_ms:.2f} | "
            f"{run.host_share:.1%} |"
        )
    ratio = ""
    if True in runs and False in runs:
        on = statistics.median(r.step_ms for r in runs[True])
        off = statistics.median(r.step_ms for r in runs[False])
        ratio = f"\nStep time with async on / off: **{on / off:.2f}x** (same run, same engines).\n"
    table = "\n".join(
        [
            "| async scheduling | step (ms) | device (ms) | host work outside the device's time |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(table + ratio)
    if args.no_write:
        return
    body = (
        f"`{command_line()}` — {machine_line()}, load {load_average()}.\n\n"
        f"Batch {args.batch}, {args.steps} decode steps per run, median of {args.repeats}; "
        f"the stand-in device takes {device_ms:.2f} ms a step (the host's own step with async "
        "off, so off is about half host work, as on the H200). Model work is the timer's "
        "(bench/offline/async_overlap.py); the rest is the engine's real host work.\n\n"
        f"{table}\n{ratio}"
    )
    write_section("engine-async", body)
