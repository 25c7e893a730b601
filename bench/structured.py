"""Structured-output overhead: decode throughput of json_schema-constrained requests as a
ratio of the same workload unconstrained, measured in the same run on one Engine.

32 concurrent chat prompts ask for a JSON inventory; every request decodes exactly
`--max-tokens` tokens (ignore_eos; the schema asks for more items than fit, so no grammar
completes early), seeded sampling at temperature 0.7. Decode throughput counts the tokens
produced after every request has its first token, over the time that took, so prefill is
left out of both sides.

The machine is shared and its load drifts, so the two workloads run in back-to-back pairs,
`--repeats` pairs, alternating which goes first; the ratio is the median of the pairs'
ratios. The overhead share is the constrained run's time in `GrammarMasker.apply`
(computing masks on llguidance's threads, unpacking, -inf) and in advancing the matchers,
over its decode time: a load-independent reading of the same cost.

    python -m bench.structured                    # 32 requests x 96 tokens, 5 pairs
    python -m bench.structured --quick            # 32 x 48, 1 pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from bench.common.machine import load_average, machine
from bench.common.results_md import command_line, write_section
from gpu_worker import Engine
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model
from shared.protocol import Constraint, Generate
from shared.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 24},
        "items": {
            "type": "array",
            "minItems": 200,  # more than fits in the budget: no request completes early
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                    "color": {"enum": ["red", "green", "blue", "black"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "count", "color"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["store", "items"],
    "additionalProperties": False,
}
PRODUCTS = ["lamps", "kites", "teapots", "bicycles", "maps", "candles", "gloves", "clocks"]


@dataclass
class Run:
    """One pass of the workload."""

    decode_tokens: int
    decode_seconds: float
    overhead_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.decode_tokens / self.decode_seconds


class Timed:
    """Wraps a method of an object to sum the time spent in it."""

    def __init__(self, owner: object, name: str) -> None:
        self._method = getattr(owner, name)
        self.seconds = 0.0
        setattr(owner, name, self)

    def __call__(self, *args: object) -> object:
        start = time.perf_counter()
        try:
            return self._method(*args)
        finally:
            self.seconds += time.perf_counter() - start


def run(
    engine: Engine, prompts: list[list[int]], max_tokens: int, constrained: bool, tag: str
) -> Run:
    constraint = Constraint(kind="json_schema", spec=json.dumps(SCHEMA)) if constrained else None
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=True)
        request = Generate(
            request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling=sampling,
            constraint=constraint,
        )  # fmt: skip
        engine.add_request(request)
    counts = dict.fromkeys((f"{tag}-{i}" for i in range(len(prompts))), 0)
    decode_start: float | None = None
    decode_tokens = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            counts[delta.request_id] += len(delta.new_token_ids)
            if decode_start is not None:
                decode_tokens += len(delta.new_token_ids)
        if decode_start is None and all(counts.values()):
            decode_start = time.perf_counter()
    elapsed = time.perf_counter() - (decode_start or time.perf_counter())
    assert all(n == max_tokens for n in counts.values()), counts
    engine.reset_prefix_cache()
    return Run(decode_tokens, elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="48 tokens, 1 pair")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 48, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    source = resolve_model(args.model)
    renderer = ChatRenderer(Tokenizer.from_source(source))
    prompts = [
        renderer.render(
            [{"role": "user", "content": f"List the {PRODUCTS[i % 8]} of shop {i} as JSON."}],
            add_generation_prompt=True,
        ).token_ids
        for i in range(args.concurrency)
    ]
    engine = Engine(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    timers = [Timed(engine.sampler.grammar, "apply"), Timed(engine, "_advance_matchers")]
    started = f"{machine()}, load average {load_average()}"
    run(engine, prompts[:4], 8, constrained=True, tag="warm")  # tokenizer view, first masks
    run(engine, prompts[:4], 8, constrained=False, tag="warm-free")

    free: list[Run] = []
    constrained: list[Run] = []
    ratios: list[float] = []
    for repeat in range(args.repeats):
        for is_constrained in (False, True) if repeat % 2 == 0 else (True, False):
            for timer in timers:
                timer.seconds = 0.0
            tag = f"{'c' if is_constrained else 'f'}{repeat}"
            result = run(engine, prompts, args.max_tokens, is_constrained, tag)
            if is_constrained:
                # _advance_matchers runs for free rows too, but costs them one dict lookup.
                result.overhead_seconds = sum(timer.seconds for timer in timers)
                constrained.append(result)
            else:
                free.append(result)
        ratios.append(constrained[-1].rate / free[-1].rate)
        print(
            f"pair {repeat}: free {free[-1].rate:.1f} tok/s, json_schema "
            f"{constrained[-1].rate:.1f} tok/s, ratio {ratios[-1]:.2f} (structured "
            f"overhead {constrained[-1].overhead_seconds:.2f}s)",
            flush=True,
        )

    free_rate = statistics.median(r.rate for r in free)
    constrained_rate = statistics.median(r.rate for r in constrained)
    share = statistics.median(r.overhead_seconds / r.decode_seconds for r in constrained)
    ratio = statistics.median(ratios)
    table = [
        "| case | decode tok/s (median) | ratio (median of pairs) | structured overhead |",
        "|---|---:|---:|---:|",
        f"| {args.concurrency} concurrent, unconstrained | {free_rate:.1f} | 1.00 | - |",
        f"| {args.concurrency} concurrent, json_schema | {constrained_rate:.1f} "
        f"| **{ratio:.2f}** | {share:.1%} of decode time |",
        "",
        "Per-pair ratios: " + ", ".join(f"{r:.2f}" for r in ratios) + ".",
    ]
    print("\n".join(table))
    if args.no_write:
        return
    command = command_line()
    body = "\n".join(
        [
            "## structured",
            "",
            f"Machine: {started} at the start; load average {load_average()} at the end; "
            f"device {args.device}.",
            "",
            f"`{command.strip()}`: SmolLM2-135M-Instruct, {args.concurrency} concurrent chat "
            f"requests x {args.max_tokens} tokens (ignore_eos), temperature 0.7, seeded; the "
            "constrained run holds every request to a nested JSON schema (objects, arrays, "
            "enums, bounded integers and strings). Decode tok/s excludes prefill; "
            f"{args.repeats} back-to-back pairs, alternating order. Target: ratio >= 0.8.",
            "",
            *table,
        ]
    )
    write_section("structured", body)


if __name__ == "__main__":
    main()
