"""bench/engine.py's main comparison: duet's Engine against transformers on the chat
workload at each concurrency, single-stream decode, and how close both come to what the
machine allows (fp32 on CPU)."""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common.machine import cpu_model, load_average, machine
from bench.common.results_md import command_line, write_section
from bench.common.timing import Clock
from bench.common.workload import Workload
from bench.offline.engines import ForwardTimer, decode_one, make_engine, run_engine
from bench.offline.roofline import Bound, MachineLimits, ModelShape, streamed_weight_bytes
from bench.offline.transformers_side import hf_generate, load_hf, run_hf
from gpu_worker import Engine
from shared.model_source import ModelSource

Rows = list[tuple[str, "Comparison"]]
"""A run's cases: each row's label and its clocks."""


@dataclass
class Comparison:
    """Repeated clocks of one case for both systems; rates are tokens per median second."""

    tokens: int
    theirs: list[Clock] = field(default_factory=list)
    ours: list[Clock] = field(default_factory=list)
    outside_share: list[float] = field(default_factory=list)
    least: Bound | None = None
    """The least time the case can take on this machine (on CPU only)."""

    def rate(self, clocks: list[Clock], attr: str = "wall") -> float:
        return self.tokens / statistics.median(getattr(c, attr) for c in clocks)

    def row(self, label: str) -> str:
        hf, us = self.rate(self.theirs), self.rate(self.ours)
        cpu_ratio = self.rate(self.ours, "cpu") / self.rate(self.theirs, "cpu")
        share = statistics.median(self.outside_share)
        return (
            f"| {label} | {hf:.1f} | {us:.1f} | **{us / hf:.2f}x** | {cpu_ratio:.2f}x "
            f"| {share:.1%} |"
        )

    def bound_row(self, label: str) -> str:
        """How close duet is to the machine's limit, and the most any engine could gain
        over transformers under it."""
        assert self.least is not None
        ours = statistics.median(c.wall for c in self.ours)
        theirs = statistics.median(c.wall for c in self.theirs)
        least = self.least
        return (
            f"| {label} | {least.flops / 1e9:.0f} | {least.seconds:.2f} ({least.limit}) "
            f"| {ours:.2f} | {least.seconds / ours:.0%} | {theirs:.2f} "
            f"| **{theirs / least.seconds:.2f}x** |"
        )


def single_stream(
    args: argparse.Namespace, engine: Engine, timer: ForwardTimer, hf: Any, prompt: list[int]
) -> Comparison:
    """Decode rate of one request: generate(1 + n) - generate(1) on both sides, so the
    prefill cancels out; the engine's outside share is over its long run."""
    n = args.single_stream_tokens
    result = Comparison(tokens=n)
    # Cache the prompt's prefix first: otherwise the first generate(1) alone prefills it
    # and the difference undercounts decode by a prefill.
    decode_one(engine, prompt, 1)
    for _ in range(args.single_stream_repeats):
        first = Clock.measure(lambda: hf_generate(hf, [prompt], 1))
        result.theirs.append(Clock.measure(lambda: hf_generate(hf, [prompt], 1 + n)) - first)
        first = Clock.measure(lambda: decode_one(engine, prompt, 1))
        timer.seconds = 0.0
        full = Clock.measure(lambda: decode_one(engine, prompt, 1 + n))
        result.ours.append(full - first)
        result.outside_share.append(1.0 - timer.seconds / full.wall)
        print(
            f"  single stream: transformers {n / result.theirs[-1].wall:.1f} tok/s, "
            f"duet {n / result.ours[-1].wall:.1f} tok/s "
            f"({result.outside_share[-1]:.1%} outside the forward)",
            flush=True,
        )
    return result


def case_label(dtype: str, concurrency: int, case: Workload) -> str:
    """A throughput row's label: the dtype, the concurrency and the work it ran."""
    return (
        f"{dtype}, {concurrency} concurrent: {len(case.prompts)} prompts, "
        f"{case.useful_tokens} tokens"
    )


def with_single_stream(concurrencies: list[int]) -> list[int]:
    """The concurrencies to run, with 0 (an engine for the single-stream case only) where
    1 is not among them."""
    return concurrencies if 1 in concurrencies else [*concurrencies, 0]


def run_dtype(
    args: argparse.Namespace,
    dtype: str,
    work: Workload,
    source: ModelSource,
    limits: MachineLimits | None,
) -> Rows:
    """Every case for one dtype: its label, both systems' clocks and, given this machine's
    `limits` (fp32 on CPU), the least time the case could take here."""
    hf = load_hf(source, getattr(torch, dtype))
    shape = ModelShape.of(hf.config)
    rows: Rows = []
    for concurrency in with_single_stream(list(args.concurrency)):
        engine, timer = make_engine(args, dtype, max(concurrency, 1))
        if concurrency > 0:
            case = work.head(args.serial_prompts if concurrency == 1 else None)
            result = Comparison(tokens=case.useful_tokens)
            if limits is not None:
                flops = sum(
                    shape.request_flops(len(p), n)
                    for p, n in zip(case.prompts, case.output_lens, strict=True)
                )
                result.least = Bound.of(flops, limits.peak)
            for _ in range(args.repeats):
                result.theirs.append(run_hf(hf, case, concurrency))
                clock, outside = run_engine(engine, timer, case)
                result.ours.append(clock)
                result.outside_share.append(outside)
                print(
                    f"  {dtype} concurrency {concurrency}: transformers "
                    f"{result.theirs[-1].wall:.1f}s, duet {clock.wall:.1f}s "
                    f"({outside:.1%} outside the forward)",
                    flush=True,
                )
            rows.append((case_label(dtype, concurrency, case), result))
        if concurrency <= 1:
            n = args.single_stream_tokens
            label = f"{dtype}, single-stream decode, {n} tokens"
            result = single_stream(args, engine, timer, hf, work.prompts[0])
            if limits is not None:
                weight_reads = n * streamed_weight_bytes(engine.runner.model)
                flops = shape.decode_flops(len(work.prompts[0]), n)
                result.least = Bound.of(flops, limits.peak, weight_reads, limits.read_rate)
            rows.append((label, result))
        del engine, timer
        gc.collect()
    return rows


def thread_scaling(counts: list[int], by_threads: dict[int | None, Rows]) -> list[str]:
    """Each case's tok/s at the last thread count over the first, per system (wall)."""
    first, last = counts[0], counts[-1]
    table = [
        f"| case | transformers {last} / {first} threads | duet {last} / {first} threads |",
        "|---|---:|---:|",
    ]
    for (label, low), (_, high) in zip(by_threads[first], by_threads[last], strict=True):
        theirs = high.rate(high.theirs) / low.rate(low.theirs)
        ours = high.rate(high.ours) / low.rate(low.ours)
        table.append(f"| {label} | {theirs:.2f}x | **{ours:.2f}x** |")
    return table


def machine_bounds(
    by_threads: dict[int | None, Rows],
    limits_at: dict[int | None, MachineLimits],
    per_thread_count: bool,
) -> list[str]:
    """The fp32 cases against the least time this machine allows them."""
    table = [
        "What this machine allows the fp32 cases: "
        + "; ".join(
            f"{'' if t is None else f'{t} thread(s): '}{limits.describe()}"
            for t, limits in limits_at.items()
        )
        + ". The least time is the case's arithmetic (every projection, attention over the "
        "context, the LM head per sampled token) at that peak, or for single-stream decode "
        "duet's weight bytes per token at that read rate if longer; the last column is "
        "transformers' time over it, the most any engine could gain over transformers here.",
        "",
        "| case | GFLOP | least s (bound by) | duet s | duet at | transformers s "
        "| transformers / least |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for threads, rows in by_threads.items():
        for label, result in rows:
            if result.least is not None:
                name = f"{threads} thr, {label}" if per_thread_count else label
                table.append(result.bound_row(name))
    return table


def run_comparison(args: argparse.Namespace, work: Workload, source: ModelSource) -> list[str]:
    """Every case at each of `args.thread_counts` (or at `args.threads`), as the section's
    tables: the cases, the thread scaling, and the machine's bounds on CPU."""
    by_threads: dict[int | None, Rows] = {}
    limits_at: dict[int | None, MachineLimits] = {}
    for threads in args.thread_counts or [args.threads]:
        if threads is not None:
            torch.set_num_threads(threads)
        if args.device == "cpu":
            limits_at[threads] = MachineLimits.measure()
        by_threads[threads] = [
            row
            for dtype in args.dtypes
            for row in run_dtype(
                args, dtype, work, source, limits_at.get(threads) if dtype == "float32" else None
            )
        ]
    table = [
        "| case | transformers tok/s | duet tok/s | duet / transformers (wall) "
        "| duet / transformers (CPU time) | duet time outside the forward |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            result.row(label if args.thread_counts is None else f"{threads} thr, {label}")
            for threads, rows in by_threads.items()
            for label, result in rows
        ),
    ]
    if args.thread_counts is not None and len(args.thread_counts) > 1:
        table += ["", *thread_scaling(args.thread_counts, by_threads)]
    if limits_at:
        table += ["", *machine_bounds(by_threads, limits_at, args.thread_counts is not None)]
    return table


def write_engine_section(
    args: argparse.Namespace, work: Workload, table: list[str], load_at_start: str
) -> None:
    """The `engine` section of RESULTS.md: the run's setting, then its tables."""
    lens = [len(p) for p in work.prompts]
    body = "\n".join(
        [
            "## engine",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {cpu_model()}; {machine()}; load average {load_at_start} at the "
            f"start, {load_average()} at the end.",
            "",
            "SmolLM2-135M-Instruct from its Q4_1 GGUF file. transformers runs the weights "
            "dequantized to fp32; so does duet for prefill, while in fp32 it multiplies "
            "decode batches (up to 96 rows) by the file's Q4_1/Q8_0 blocks with its CPU "
            "kernel, each weight dequantized to the same fp32 value. "
            f"{len(work.prompts)} chat prompts "
            f"of {min(lens)}-{max(lens)} tokens, outputs uniform over "
            f"{min(work.output_lens)}-{max(work.output_lens)} tokens with ignore_eos. "
            "transformers runs `generate` on static left-padded batches of the concurrency; "
            "tok/s counts only the tokens each prompt asked for. Medians of "
            f"{args.repeats} run(s) per throughput case and {args.single_stream_repeats} "
            "single-stream runs, both systems back to back in one process.",
            "",
            *table,
        ]
    )
    write_section("engine", body)
