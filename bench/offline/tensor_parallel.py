"""bench/engine.py at `--tensor-parallel-size N`: duet at TP=N against itself at TP=1 with
as many threads in one process, and the share of each TP=N run spent in each collective
(torch.profiler in rank 0's process); the `engine-tp` section of RESULTS.md."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.common.machine import cpu_model, load_average, machine
from bench.common.results_md import command_line, write_section
from bench.common.timing import Clock
from bench.common.workload import Workload
from bench.offline.comparison import case_label, with_single_stream
from bench.offline.engines import ForwardTimer, decode_one, make_engine, run_engine
from gpu_worker import Engine

COLLECTIVES = ("all-reduce", "logits gather", "step broadcast")
GLOO_RANGES = {
    "gloo:all_reduce": "all-reduce",
    "gloo:gather": "logits gather",
    "gloo:broadcast": "step broadcast",  # over gloo on CUDA too: the host group carries it
}


def collective_of(event: Any, on_cuda: bool) -> str | None:
    """Which of COLLECTIVES a profiler event times, if any. NCCL's host ranges only
    enqueue its kernels, so on CUDA the kernels are counted (they too wait for every rank);
    NCCL runs a gather as sends and receives."""
    name: str = event.name
    if name in GLOO_RANGES:
        return GLOO_RANGES[name]
    if on_cuda and event.device_type == DeviceType.CUDA and name.startswith("nccl"):
        if "AllReduce" in name:
            return "all-reduce"
        if "SendRecv" in name or "Gather" in name:
            return "logits gather"
    return None


def profile_collectives(
    device: torch.device, fn: Callable[[], Clock]
) -> tuple[float, dict[str, float]]:
    """The wall seconds of `fn` under torch.profiler and the seconds in each collective."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities) as prof:
        wall = fn().wall
    seconds = dict.fromkeys(COLLECTIVES, 0.0)
    for event in prof.events():
        name = collective_of(event, on_cuda)
        if name is not None:
            seconds[name] += event.time_range.elapsed_us() / 1e6
    return wall, seconds


@dataclass
class Side:
    """One engine of the TP comparison and the torch threads of its own process."""

    engine: Engine
    timer: ForwardTimer
    threads: int

    def run(self, work: Workload) -> Clock:
        torch.set_num_threads(self.threads)
        return run_engine(self.engine, self.timer, work)[0]

    def decode(self, prompt: list[int], new_tokens: int) -> Clock:
        torch.set_num_threads(self.threads)
        return Clock.measure(lambda: decode_one(self.engine, prompt, new_tokens))


@dataclass
class TPComparison:
    """One case at TP=1 and TP=N in turns (rates: tokens per median wall second), and one
    more TP=N run under the profiler: its wall and its seconds in each collective.
    `tp_calls` are the unprofiled walls of the very call profiled, for its overhead."""

    tokens: int
    single: list[Clock] = field(default_factory=list)
    tp: list[Clock] = field(default_factory=list)
    tp_calls: list[float] = field(default_factory=list)
    profiled_wall: float = 0.0
    collective_seconds: dict[str, float] = field(default_factory=dict)

    def rate(self, clocks: list[Clock]) -> float:
        return self.tokens / statistics.median(c.wall for c in clocks)

    def row(self, label: str) -> str:
        one, many = self.rate(self.single), self.rate(self.tp)
        shares = " | ".join(
            f"{self.collective_seconds[name] / self.profiled_wall:.1%}" for name in COLLECTIVES
        )
        slowdown = self.profiled_wall / statistics.median(self.tp_calls) - 1.0
        return (
            f"| {label} | {one:.1f} | {many:.1f} | **{many / one:.2f}x** | {shares} "
            f"| {slowdown:+.0%} |"
        )


def tp_throughput(single: Side, tp: Side, case: Workload, repeats: int) -> TPComparison:
    result = TPComparison(tokens=case.useful_tokens)
    for _ in range(repeats):
        result.single.append(single.run(case))
        result.tp.append(tp.run(case))
        result.tp_calls.append(result.tp[-1].wall)
        print(
            f"  {len(case.prompts)} prompts: TP=1 {result.single[-1].wall:.1f}s, "
            f"TP={tp.engine.config.tensor_parallel_size} {result.tp[-1].wall:.1f}s",
            flush=True,
        )
    result.profiled_wall, result.collective_seconds = profile_collectives(
        tp.engine.device, lambda: tp.run(case)
    )
    return result


def tp_single_stream(
    single: Side, tp: Side, prompt: list[int], n: int, repeats: int
) -> TPComparison:
    """Decode rate of one request, generate(1 + n) - generate(1) as in `single_stream`; the
    profiled run is one generate(1 + n), its prefill included."""
    result = TPComparison(tokens=n)
    for _ in range(repeats):
        for side, clocks in ((single, result.single), (tp, result.tp)):
            first = side.decode(prompt, 1)
            full = side.decode(prompt, 1 + n)
            clocks.append(full - first)
            if side is tp:
                result.tp_calls.append(full.wall)
        print(
            f"  single stream: TP=1 {n / result.single[-1].wall:.1f} tok/s, "
            f"TP={tp.engine.config.tensor_parallel_size} {n / result.tp[-1].wall:.1f} tok/s",
            flush=True,
        )
    result.profiled_wall, result.collective_seconds = profile_collectives(
        tp.engine.device, lambda: tp.decode(prompt, 1 + n)
    )
    return result


def run_tp_dtype(args: argparse.Namespace, dtype: str, work: Workload) -> list[str]:
    """Every case for one dtype at TP=1 and TP=N, as table rows. Both engines live through
    a concurrency's cases, so their runs can take turns."""
    size, per_rank = args.tensor_parallel_size, args.threads or 1
    os.environ["OMP_NUM_THREADS"] = str(per_rank)  # read by each spawned rank's torch
    rows: list[str] = []
    for concurrency in with_single_stream(list(args.concurrency)):
        seqs = max(concurrency, 1)
        torch.set_num_threads(per_rank * size)
        # Dense weights, as the ranks have: the GGUF kernel is for a single rank only.
        single_engine = make_engine(args, dtype, seqs, cpu_gguf_kernels=False)
        single = Side(*single_engine, threads=per_rank * size)
        torch.set_num_threads(per_rank)
        tp_engine = make_engine(
            args, dtype, seqs, tensor_parallel_size=size, dist_timeout_s=args.dist_timeout_s
        )
        tp = Side(*tp_engine, threads=per_rank)
        with tp.engine:
            if concurrency > 0:
                case = work.head(args.serial_prompts if concurrency == 1 else None)
                result = tp_throughput(single, tp, case, args.repeats)
                rows.append(result.row(case_label(dtype, concurrency, case)))
            if concurrency <= 1:
                n = args.single_stream_tokens
                result = tp_single_stream(
                    single, tp, work.prompts[0], n, args.single_stream_repeats
                )
                rows.append(result.row(f"{dtype}, single-stream decode, {n} tokens"))
        del single, tp, single_engine, tp_engine
        gc.collect()
    return rows


def write_tp_section(
    args: argparse.Namespace, work: Workload, rows: list[str], load_at_start: str
) -> None:
    size, per_rank = args.tensor_parallel_size, args.threads or 1
    lens = [len(p) for p in work.prompts]
    table = [
        f"| case | TP=1, {size * per_rank} threads: tok/s | TP={size}, {size} ranks x "
        f"{per_rank} thread(s): tok/s | TP={size} / TP=1 (wall) | all-reduce share "
        "| logits gather share | step broadcast share | profiler's slowdown |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    print("\n".join(table))
    if args.no_write:
        return
    body = "\n".join(
        [
            "## engine-tp",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {cpu_model()}; {machine()}; load average {load_at_start} at the "
            f"start, {load_average()} at the end.",
            "",
            f"duet against itself: TP={size} ({size} ranks of {per_rank} torch thread(s), "
            f"{args.device}) against TP=1 ({size * per_rank} threads in one process), "
            "built-in SmolLM2-135M-Instruct from its Q4_1 GGUF file, dequantized to dense "
            "weights on both sides (TP=1 without its single-rank GGUF decode kernel). "
            f"{len(work.prompts)} chat prompts of "
            f"{min(lens)}-{max(lens)} tokens, outputs uniform over "
            f"{min(work.output_lens)}-{max(work.output_lens)} tokens with ignore_eos; "
            f"single stream as generate(1 + n) - generate(1). Medians of {args.repeats} "
            f"run(s) per throughput case and {args.single_stream_repeats} single-stream "
            "runs, TP=1 and TP=N in turns in one invocation. Shares: one more TP=N run per "
            "case under torch.profiler in rank 0's process, the time in gloo's "
            "all_reduce, gather and broadcast ranges over that run's wall time (waits for "
            "the other rank included; the single-stream run includes its prefill); the "
            "last column is how much slower the profiled run was than the median "
            "unprofiled one. On a machine with several GPUs, the same command with "
            "`--device cuda` is the multi-GPU benchmark (none "
            "available yet).",
            "",
            *table,
        ]
    )
    write_section("engine-tp", body)
