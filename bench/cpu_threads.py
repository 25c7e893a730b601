"""Where a CPU decode step goes, with 1 and 2 torch threads, and the memory bandwidth.

    python bench/cpu_threads.py [--threads 1 2] [--concurrency 32] [--steps 30] [--no-write]

(a) A decode step at --concurrency sequences of the built-in model (64 chat prompts'
    first N, decoded past their prefill), each part timed by a wrapper around it: the
    projections (GGUF kernel or dense, `Linear`), the LM head, decode attention and the
    KV write (duet's CPU kernels), norms, rotary and SiLU-mul (layer ops), the sampler,
    and the rest of the step (scheduling, batch building, bookkeeping: Python).
    Thread counts alternate, twice each, in one process; medians per step.
(b) Memory bandwidth at each thread count: a read of a 512 MiB fp32 tensor (a sum) and
    a copy of one, the bytes a decode step streams at best; with the step's weight and KV
    bytes it says how far the step is from the memory limit.

Writes the `cpu_threads` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import roofline
import torch
from engine import build_workload, cpu_model, load_average, machine
from results_md import command_line, write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker import Engine  # noqa: E402
from gpu_worker.ops import cpu_ops, layer_ops, linear  # noqa: E402
from render_server.templating.chat_template import ChatRenderer  # noqa: E402
from render_server.templating.tokenizer import Tokenizer  # noqa: E402
from shared.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from shared.protocol import Generate  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


class PartTimer:
    """Seconds spent in each wrapped callable, by part name; nested parts are not
    double-counted (an outer part's time excludes the inner ones it called)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = self._stack.pop()
                self.seconds[part] += elapsed - nested
                if self._stack:
                    self._stack[-1] += elapsed

        setattr(owner, name, timed)


def instrument(engine: Engine, timer: PartTimer) -> None:
    timer.wrap(linear.Linear, "forward", "projections")
    timer.wrap(cpu_ops, "paged_decode_attention", "attention")
    timer.wrap(cpu_ops, "write_kv", "KV write")
    timer.wrap(cpu_ops, "rms_norm", "norms")
    timer.wrap(cpu_ops, "add_rms_norm", "norms")
    for ops in (c for c in vars(layer_ops).values() if isinstance(c, type)):
        for name, part in (("rotate", "rotary"), ("silu_and_mul", "SiLU-mul")):
            if name in vars(ops):
                timer.wrap(ops, name, part)
    timer.wrap(type(engine.runner.model), "compute_logits", "LM head")
    timer.wrap(engine.sampler, "sample", "sampler")


@contextmanager
def threads(count: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def decode_steps(
    engine: Engine, prompts: list[list[int]], steps: int, tag: str, timer: PartTimer
) -> float:
    """Prefill `prompts`, then time `steps` decode steps (the timer's parts start over
    there); seconds per step."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        request = Generate(request_id=request_id, prompt_token_ids=prompt, sampling=params)
        engine.add_request(request)
    while engine.scheduler.num_waiting or any(
        s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    timer.seconds.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    engine.abort(ids)
    return seconds


def bandwidth(count: int) -> tuple[float, float]:
    """GB/s of a sum over 512 MiB and of a 512 MiB copy, with `count` threads."""
    with threads(count):
        read, copy = roofline.bandwidth()
    return read / 1e9, copy / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start_load = load_average()
    renderer = ChatRenderer(Tokenizer.from_source(resolve_model(DEFAULT_MODEL)))
    prompts = build_workload(renderer, 64, 256, 0).prompts[: args.concurrency]
    engine = Engine(device="cpu", max_num_seqs=args.concurrency)
    timer = PartTimer()
    instrument(engine, timer)
    parts: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for round_ in range(args.rounds):
        for count in args.threads:
            with threads(count):
                seconds = decode_steps(engine, prompts, args.steps, f"{round_}-{count}", timer)
            for part, total in timer.seconds.items():
                parts[count][part].append(total / args.steps)
            parts[count]["step"].append(seconds)
            print(count, f"{1000 * seconds:.1f} ms/step", flush=True)
    first, last = args.threads[0], args.threads[-1]
    medians = {c: {p: statistics.median(v) for p, v in parts[c].items()} for c in args.threads}
    for c in args.threads:
        timed = sum(v for p, v in medians[c].items() if p != "step")
        medians[c]["rest (Python: schedule, prepare, bookkeeping)"] = max(
            medians[c]["step"] - timed, 0.0
        )
    names = sorted((p for p in medians[first] if p != "step"), key=lambda p: -medians[first][p]) + [
        "step"
    ]
    rows = []
    for part in names:
        a, b = medians[first].get(part, 0.0), medians[last].get(part, 0.0)
        share = a / medians[first]["step"]
        rows.append(
            f"| {part} | {1000 * a:.2f} | {share:.0%} | {1000 * b:.2f} | **{a / b:.2f}x** |"
            if b > 0
            else f"| {part} | {1000 * a:.2f} | {share:.0%} | - | - |"
        )
    bw = {c: bandwidth(c) for c in args.threads}
    weights = roofline.streamed_weight_bytes(engine.runner.model)
    body = [
        "## cpu_threads",
        "",
        f"`{command_line()}`",
        "",
        f"Machine: {cpu_model()}; {machine()}; load average {start_load} at the start, "
        f"{load_average()} at the end.",
        "",
        f"A decode step at {args.concurrency} sequences (SmolLM2-135M Q4_1, fp32, prompts "
        f"of ~100-150 tokens), ms per step by part, medians of {args.rounds} x "
        f"{args.steps} steps per thread count, counts alternating in one process.",
        "",
        f"| part | {first} thread ms | share | {last} threads ms | speedup |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"Memory: the step reads {weights / 1e6:.0f} MB of weights (GGUF blocks), "
        + "; ".join(
            f"{c} thread(s): a 512 MiB read {bw[c][0]:.1f} GB/s, a copy {bw[c][1]:.1f} GB/s"
            for c in args.threads
        )
        + ". At "
        + ", ".join(
            f"{c} thread(s) the step's weight bytes alone take "
            f"{1000 * weights / (bw[c][0] * 1e9):.1f} ms at the read rate"
            for c in args.threads
        )
        + ".",
    ]
    print("\n".join(body))
    if not args.no_write:
        write_section("cpu_threads", "\n".join(body))


if __name__ == "__main__":
    main()
