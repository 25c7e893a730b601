"""Engine throughput: duet's continuous-batching Engine against transformers, same run.

(a) throughput: N chat prompts (100-150 tokens, seeded made-up content), output lengths
    spread uniformly over [16, --max-output] with ignore_eos. duet runs them all through one
    Engine with `--max-num-seqs C`; transformers runs `generate` on static batches of C
    (left-padded, each batch decoding until its longest request). Only useful tokens count:
    each prompt's own requested length.
(b) single-stream decode: one request, 128 new tokens, timed as generate(1 + n) - generate(1)
    on both sides so the prefill cancels out.
(c) the share of engine time spent outside the model forward (scheduling, batch building,
    sampling, bookkeeping), from perf_counter around the model's forward and LM head.

The machine may be shared, so every case runs both systems back to back in one process,
`--repeats` times, and the table gives medians and their ratio. Besides wall time, each
case records the process's CPU time: with `--threads 1` that ratio does not move when
other jobs take the core away, so it is the steadier comparison on a busy box.

With `--tensor-parallel-size N` (N > 1) the run is instead duet against itself: TP=N
(N ranks of `--threads` torch threads each, default 1) against TP=1 (one process of
N x `--threads` threads), the same cases (a) and (b) in turns, and the transformers
baseline is skipped. TP=1 runs without the CPU GGUF decode kernel, on dense weights as
every rank of TP=N does (the loader keeps that kernel to one rank alone), so the split is
the only difference. The spawned ranks take their thread count from OMP_NUM_THREADS,
which the bench sets before starting them. Each case then runs TP=N once more under
torch.profiler, in rank 0's process, for the share of that run's wall time spent in each
collective: the layers' all-reduces, the gather of the logits to rank 0 and the
broadcast of each step's batch. On CPU these are gloo's "gloo:<op>" ranges, which last
until every rank has joined, so they include waiting for the slower rank. The section
goes to RESULTS.md as `engine-tp`. On a machine with N GPUs the same command with
`--device cuda` is the multi-GPU benchmark (one GPU per rank,
NCCL); there the shares count NCCL's kernels, whose names have not yet been checked on
such a machine (none was available).

    python bench/engine.py                      # the full run (long on a 2-core CPU)
    python bench/engine.py --quick --threads 1  # 32 prompts, outputs up to 64 tokens
    python bench/engine.py --dtypes float32 bfloat16
    python bench/engine.py --quick --tensor-parallel-size 2  # 2 ranks x 1 vs 1 x 2 threads
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from results_md import command_line, write_section
from roofline import Bound, MachineLimits, ModelShape, streamed_weight_bytes
from safetensors.torch import save_file
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gpu_worker import Engine
from gpu_worker.lora.adapter import target_shapes
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, ModelSource, resolve_model
from shared.sampling import SamplingParams

TOPICS = [
    "astronomy", "baking bread", "bicycle repair", "chess openings", "coastal birds",
    "container shipping", "desert plants", "early printing", "glass blowing", "honey bees",
    "jazz harmony", "lighthouses", "medieval castles", "mountain weather", "origami",
    "pottery glazes", "railway signals", "river deltas", "sailing knots", "tea ceremonies",
]  # fmt: skip
WORDS = [
    "why", "how", "when", "where", "which", "would", "could", "should", "explain",
    "describe", "compare", "list", "the", "a", "an", "of", "to", "in", "on", "for", "with",
    "about", "between", "during", "after", "before", "under", "over", "small", "large",
    "old", "new", "history", "method", "tools", "process", "reason", "example",
    "difference", "effect", "cause", "season", "material", "color", "shape", "speed",
    "weight", "price", "market", "village", "city", "island", "winter", "summer",
    "morning", "night", "careful", "simple", "quick", "slow", "early", "late", "common",
    "rare", "local", "famous", "modern", "ancient", "practical", "steps", "rules",
    "mistakes", "habits", "questions", "answers", "details", "sources", "ideas",
    "problems", "results",
]  # fmt: skip
PAD_TOKEN_ID = 2  # SmolLM2's <|im_end|>; pads are masked out, so any id would do
COLLECTIVES = ("all-reduce", "logits gather", "step broadcast")
GLOO_RANGES = {
    "gloo:all_reduce": "all-reduce",
    "gloo:gather": "logits gather",
    "gloo:broadcast": "step broadcast",  # over gloo on CUDA too: the host group carries it
}


@dataclass
class Workload:
    """The prompts and the number of new tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int | None) -> Workload:
        if n is None:
            return self
        return Workload(self.prompts[:n], self.output_lens[:n])


@dataclass
class Clock:
    """Wall and process-CPU seconds of one measured call."""

    wall: float
    cpu: float

    @classmethod
    def measure(cls, fn: Callable[[], object]) -> Clock:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return cls(time.perf_counter() - wall, time.process_time() - cpu)

    def __sub__(self, other: Clock) -> Clock:
        return Clock(self.wall - other.wall, self.cpu - other.cpu)


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


def build_workload(
    renderer: ChatRenderer, num_prompts: int, max_output: int, seed: int
) -> Workload:
    """Chat prompts of 100-150 tokens from made-up questions, and uniform output lengths."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num_prompts:
        topic = rng.choice(TOPICS)
        target = rng.randint(100, 150)
        words: list[str] = []
        while True:
            words.append(rng.choice(WORDS))
            messages = [
                {"role": "system", "content": f"You are a patient expert on {topic}."},
                {"role": "user", "content": f"A question on {topic}: {' '.join(words)}?"},
            ]
            ids = renderer.render(messages, add_generation_prompt=True).token_ids
            if len(ids) >= target:
                break
        if len(ids) <= 150:  # the last word may overshoot; draw again then
            prompts.append(ids)
    min_output = min(16, max_output)
    return Workload(prompts, [rng.randint(min_output, max_output) for _ in prompts])


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
    runner.model = timer
    graphs = runner.decode_graphs
    if graphs is not None:
        replay = graphs.run
        graphs.run = lambda *a, **kw: timer.timed(replay, *a, **kw)  # type: ignore[method-assign]
    return timer


def make_engine(
    args: argparse.Namespace, dtype: str, max_num_seqs: int, **engine_args: Any
) -> tuple[Engine, ForwardTimer]:
    engine = Engine(
        model=args.model,
        device=args.device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        **engine_args,
    )
    timer = time_forward(engine)
    # Warm up on prompts outside the workload, then forget them from the prefix cache.
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


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """One static batch: left-pad, then decode exactly `new_tokens` for every row."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # with max_new_tokens: EOS never ends a row early
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )
    assert out.shape[1] == width + new_tokens


def run_hf(model: Any, work: Workload, batch_size: int) -> Clock:
    def run() -> None:
        for i in range(0, len(work.prompts), batch_size):
            batch = work.prompts[i : i + batch_size]
            hf_generate(model, batch, max(work.output_lens[i : i + batch_size]))

    return Clock.measure(run)


def load_hf(source: ModelSource, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=dtype
    )
    model = model.eval()
    hf_generate(model, [[100 + i for i in range(120)]] * 4, 8)  # first-call costs
    return model


def decode_one(engine: Engine, prompt: list[int], new_tokens: int) -> None:
    """One greedy request of exactly `new_tokens` tokens (the single-stream case)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], params)


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


def _case_label(dtype: str, concurrency: int, case: Workload) -> str:
    """A throughput row's label: the dtype, the concurrency and the work it ran."""
    return (
        f"{dtype}, {concurrency} concurrent: {len(case.prompts)} prompts, "
        f"{case.useful_tokens} tokens"
    )


def run_dtype(
    args: argparse.Namespace,
    dtype: str,
    work: Workload,
    source: ModelSource,
    limits: MachineLimits | None,
) -> list[tuple[str, Comparison]]:
    """Every case for one dtype: its label, both systems' clocks and, given this machine's
    `limits` (fp32 on CPU), the least time the case could take here."""
    hf = load_hf(source, getattr(torch, dtype))
    shape = ModelShape.of(hf.config)
    rows: list[tuple[str, Comparison]] = []
    concurrencies = list(args.concurrency)
    if 1 not in concurrencies:
        concurrencies.append(0)  # an engine for the single-stream case only
    for concurrency in concurrencies:
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
            rows.append((_case_label(dtype, concurrency, case), result))
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


def thread_scaling(
    counts: list[int], by_threads: dict[int | None, list[tuple[str, Comparison]]]
) -> list[str]:
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
    by_threads: dict[int | None, list[tuple[str, Comparison]]],
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
    concurrencies = list(args.concurrency)
    if 1 not in concurrencies:
        concurrencies.append(0)  # engines for the single-stream case only
    for concurrency in concurrencies:
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
                label = _case_label(dtype, concurrency, case)
                rows.append(result.row(label))
            if concurrency <= 1:
                n = args.single_stream_tokens
                result = tp_single_stream(
                    single, tp, work.prompts[0], n, args.single_stream_repeats
                )
                rows.append(result.row(f"{dtype}, single-stream decode, {n} tokens"))
        del single, tp, single_engine, tp_engine
        gc.collect()
    return rows


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), "
        f"Python {platform.python_version()}"
    )


def cpu_model() -> str:
    """The CPU's name and the vector extensions that decide fp32/bf16 matmul speed."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "")
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name or platform.machine()} ({', '.join(wanted) or 'no AVX2'})"


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


LORA_RANK = 16


def write_random_adapters(engine: Engine, count: int, out: Path) -> list[str]:
    """`count` random PEFT adapters (rank 16, all 7 targets of every layer) in `out`;
    returns `--lora-modules` entries (name=path)."""
    shapes = target_shapes(engine.model_config)
    modules = []
    for index in range(count):
        name = f"adapter{index}"
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for (layer, target), (in_f, out_f) in shapes.items():
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(LORA_RANK, in_f, generator=gen) / in_f**0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, LORA_RANK, generator=gen) * 0.01
        adapter_dir = out / name
        adapter_dir.mkdir()
        save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": LORA_RANK,
            "lora_alpha": 2 * LORA_RANK,
            "target_modules": sorted({target for _, target in shapes}),
        }
        (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
        modules.append(f"{name}={adapter_dir}")
    return modules


def run_lora(args: argparse.Namespace, work: Workload) -> list[str]:
    """tok/s at 32 concurrent, requests round-robin over N adapters, against the base model
    on the same engine (LoRA on, base-only steps skip the adapters), for each N."""
    concurrency = 32
    case = work.head(concurrency)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in case.output_lens
    ]
    most = max(args.lora)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = Engine(model=args.model, device=args.device, kv_cache_memory_gb=0.01)
        modules = write_random_adapters(probe, most, Path(tmp))
        del probe
        engine = Engine(
            model=args.model,
            device=args.device,
            dtype=args.dtypes[0],
            max_num_seqs=concurrency,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_lora=True,
            max_loras=most,
            max_lora_rank=LORA_RANK,
            lora_modules=modules,
        )
        names = [module.split("=", 1)[0] for module in modules]

        def rate(adapters: int) -> float:
            lora_names: list[str | None] = [
                None if adapters == 0 else names[i % adapters] for i in range(len(case.prompts))
            ]
            engine.reset_prefix_cache()
            clock = Clock.measure(
                lambda: engine.generate(case.prompts, params, lora_names=lora_names)
            )
            return case.useful_tokens / clock.wall

        rate(0)  # warm-up
        for adapters in [0, *args.lora]:
            rate(adapters)  # each side warm once (slot fills), then timed
        for adapters in args.lora:
            base = statistics.median(rate(0) for _ in range(args.repeats))
            lora = statistics.median(rate(adapters) for _ in range(args.repeats))
            rows.append(
                f"| {adapters} | {base:.1f} | {lora:.1f} | **{lora / base:.2f}x** "
                f"| {(1 - lora / base) * 100:.0f}% |"
            )
            print(rows[-1], flush=True)
    return rows


def write_lora_section(args: argparse.Namespace, case_tokens: str, rows: list[str]) -> None:
    body = "\n".join(
        [
            "## engine-lora",
            "",
            f"`{command_line()}`",
            "",
            f"Machine: {cpu_model()}; {machine()}; load average {load_average()}.",
            "",
            f"SmolLM2-135M-Instruct, {args.dtypes[0]}, 32 concurrent requests ({case_tokens}), "
            "greedy with ignore_eos, whole-workload tok/s (decode-dominated); the LoRA side "
            "spreads the requests round-robin over N random PEFT adapters (rank 16, all 7 "
            "targets of every layer), the base side names none, both on one engine with "
            f"--enable-lora --max-loras {max(args.lora)}, alternating, medians of "
            f"{args.repeats}. Issue target: 8 adapters at most 30% slower than the base.",
            "",
            "| adapters | base tok/s | LoRA tok/s | LoRA / base | slower by |",
            "|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_section("engine-lora", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32"], help="each runs on both systems"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256, help="longest requested output")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--serial-prompts",
        type=int,
        default=None,
        help="prompts for concurrency 1 (default: all); the serial case is the slowest",
    )
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each throughput case")
    parser.add_argument("--single-stream-repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (per rank at TP > 1)"
    )
    parser.add_argument(
        "--thread-counts",
        type=int,
        nargs="+",
        default=None,
        help="instead of --threads: every case at each count in turn, and each system's "
        "speedup from the first count to the last",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="above 1: duet at this TP against duet at TP=1 with as many threads in all",
    )
    parser.add_argument("--dist-timeout-s", type=float, default=120.0, help="at TP > 1")
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="the KV cache size (default: profiled on CUDA, 1 GiB on CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 prompts, outputs up to 64, 8 prompts serially, 64-token single stream",
    )
    parser.add_argument(
        "--lora",
        type=int,
        nargs="+",
        help="instead: 32 concurrent requests over N random adapters against the base model",
    )
    parser.add_argument(
        "--speculative",
        dest="methods",
        nargs="+",
        choices=["ngram", "suffix", "draft_model"],
        help="instead: speculative decoding with these methods against none on copy-heavy "
        "and mixed chat workloads at --concurrency (bench/speculative.py)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_output, args.serial_prompts = 32, 64, 8
        args.single_stream_tokens = 64
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.methods:
        from speculative import run_speculative  # it imports this module

        run_speculative(args)
        return

    source = resolve_model(args.model)
    renderer = ChatRenderer(Tokenizer.from_source(source))
    work = build_workload(renderer, args.num_prompts, args.max_output, args.seed)
    lens = [len(p) for p in work.prompts]
    print(
        f"{len(work.prompts)} prompts of {min(lens)}-{max(lens)} tokens, outputs "
        f"{min(work.output_lens)}-{max(work.output_lens)} ({work.useful_tokens} tokens)",
        flush=True,
    )
    load_at_start = load_average()
    if args.lora:
        case = work.head(32)
        lora_rows = run_lora(args, work)
        tokens = f"prompts of {min(map(len, case.prompts))}-{max(map(len, case.prompts))} tokens"
        write_lora_section(args, f"{tokens}, {case.useful_tokens} output tokens", lora_rows)
        return
    if args.tensor_parallel_size > 1:
        tp_rows = [row for dtype in args.dtypes for row in run_tp_dtype(args, dtype, work)]
        write_tp_section(args, work, tp_rows, load_at_start)
        return
    by_threads: dict[int | None, list[tuple[str, Comparison]]] = {}
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
    print("\n".join(table))
    if args.no_write:
        return
    command = command_line()
    body = "\n".join(
        [
            "## engine",
            "",
            f"`{command}`",
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


if __name__ == "__main__":
    main()
