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

    python bench/engine.py                      # the full run (long on a 2-core CPU)
    python bench/engine.py --quick --threads 1  # 32 prompts, outputs up to 64 tokens
    python bench/engine.py --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from results_md import command_line, write_section

from gpu_worker import Engine
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


def make_engine(
    args: argparse.Namespace, dtype: str, max_num_seqs: int, **engine_args: Any
) -> tuple[Engine, ForwardTimer]:
    engine = Engine(
        model=args.model,
        device=args.device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        **engine_args,
    )
    timer = ForwardTimer(engine.runner.model, engine.device)
    engine.runner.model = timer
    graphs = engine.runner.decode_graphs
    if graphs is not None:  # replays bypass runner.model; they are forward time too
        run_graph = graphs.run
        graphs.run = lambda *a, **kw: timer.timed(run_graph, *a, **kw)  # type: ignore[method-assign]
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


def single_stream(
    args: argparse.Namespace, engine: Engine, timer: ForwardTimer, hf: Any, prompt: list[int]
) -> Comparison:
    """Decode rate of one request: generate(1 + n) - generate(1) on both sides, so the
    prefill cancels out; the engine's outside share is over its long run."""
    n = args.single_stream_tokens
    result = Comparison(tokens=n)

    def ours(new_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.generate([prompt], params)

    for _ in range(args.single_stream_repeats):
        first = Clock.measure(lambda: hf_generate(hf, [prompt], 1))
        result.theirs.append(Clock.measure(lambda: hf_generate(hf, [prompt], 1 + n)) - first)
        first = Clock.measure(lambda: ours(1))
        timer.seconds = 0.0
        full = Clock.measure(lambda: ours(1 + n))
        result.ours.append(full - first)
        result.outside_share.append(1.0 - timer.seconds / full.wall)
        print(
            f"  single stream: transformers {n / result.theirs[-1].wall:.1f} tok/s, "
            f"duet {n / result.ours[-1].wall:.1f} tok/s "
            f"({result.outside_share[-1]:.1%} outside the forward)",
            flush=True,
        )
    return result


def run_dtype(
    args: argparse.Namespace, dtype: str, work: Workload, source: ModelSource
) -> list[str]:
    """Every case for one dtype, as table rows."""
    hf = load_hf(source, getattr(torch, dtype))
    rows: list[str] = []
    concurrencies = list(args.concurrency)
    if 1 not in concurrencies:
        concurrencies.append(0)  # an engine for the single-stream case only
    for concurrency in concurrencies:
        engine, timer = make_engine(args, dtype, max(concurrency, 1))
        if concurrency > 0:
            case = work.head(args.serial_prompts if concurrency == 1 else None)
            result = Comparison(tokens=case.useful_tokens)
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
            label = (
                f"{dtype}, {concurrency} concurrent: {len(case.prompts)} prompts, "
                f"{case.useful_tokens} tokens"
            )
            rows.append(result.row(label))
        if concurrency <= 1:
            n = args.single_stream_tokens
            label = f"{dtype}, single-stream decode, {n} tokens"
            rows.append(single_stream(args, engine, timer, hf, work.prompts[0]).row(label))
        del engine, timer
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
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 prompts, outputs up to 64, 8 prompts serially, 64-token single stream",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_output, args.serial_prompts = 32, 64, 8
        args.single_stream_tokens = 64
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

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
    rows = [row for dtype in args.dtypes for row in run_dtype(args, dtype, work, source)]
    table = [
        "| case | transformers tok/s | duet tok/s | duet / transformers (wall) "
        "| duet / transformers (CPU time) | duet time outside the forward |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
    ]
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
