"""--cpu-precision exact against fast, same process, alternating.

    python -m bench.cpu_precision [--threads 2] [--repeats 3] [--no-write]

Two parts:

`layers`: each projection of the built-in model (SmolLM2-135M: fused qkv, o, fused
gate_up and down in Q4_1 over 30 layers, the tied LM head in Q8_0) at decode and prefill
row counts, on the GGUF kernel (up to 96 rows, what exact decode runs), dense fp32 (what
exact prefill runs) and the packed bf16 copy fast adds; one pass runs one projection
through every layer's weights in turn. Where bf16 overtakes the kernel sets
`gpu_worker.ops.linear.FAST_MIN_ROWS`.

`engine`: the same Engine arguments but --cpu-precision: single-stream greedy decode
(generate(1 + n) - generate(1)), the bench/engine.py workload (64 chat prompts, outputs
16-256 tokens, ignore_eos) at --concurrency, and a prefill-only pass of those prompts
(max_tokens 1). Tok/s are medians of --repeats alternating runs; the outputs of fast are
compared with exact's, token for token.

Writes the `cpu_precision` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from bench.common.machine import cpu_model, load_average, machine
from bench.common.results_md import command_line, write_section
from bench.common.timing import Clock, median_ms
from bench.common.workload import build_workload
from gpu_worker import Engine
from gpu_worker.ops.cpu_precision import bf16_copy, bf16_instructions
from gpu_worker.ops.linear import FAST_MIN_ROWS, Linear, fast_linear
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model
from shared.sampling import SamplingParams

LAYER_ROWS = [1, 4, 8, 9, 16, 32, 64, 96, 256]
PROJECTIONS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


def layer_rows(engine: Engine, repeats: int) -> list[str]:
    """Per projection and row count: kernel, dense fp32 and bf16 ms per pass over all
    layers, and the kernel's (or dense's, past 96 rows) time over bf16's."""
    model = engine.runner.model
    by_kind: dict[str, list[Linear]] = {}
    for name, module in model.named_modules():
        kind = PROJECTIONS.get(name.rpartition(".")[2])
        if kind is not None and isinstance(module, Linear):
            by_kind.setdefault(kind, []).append(module)
    head = model.logits_head
    rows = []
    for kind, layers in by_kind.items():
        weights = [layer.weight.detach() for layer in layers]
        blocks = [layer.quantized for layer in layers]
        copies = [bf16_copy(w) for w in weights]
        rows += _layer_case(f"{kind} {tuple(weights[0].shape)} x{len(layers)}", weights, blocks,
                            copies, repeats)  # fmt: skip
    weight = model.head_weight().detach()
    rows += _layer_case(f"lm_head {tuple(weight.shape)} x1", [weight], [head.quantized],
                        [bf16_copy(weight)], repeats)  # fmt: skip
    return rows


def _layer_case(label, weights, blocks, copies, repeats) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    for m in LAYER_ROWS:
        x = torch.randn(m, weights[0].shape[1])
        dense = median_ms(lambda x=x: [F.linear(x, w) for w in weights], repeats)
        fast = median_ms(lambda x=x: [fast_linear(x, c) for c in copies], repeats)
        if all(b is not None and b.accepts(x) for b in blocks):
            kernel = median_ms(lambda x=x: [b.linear(x) for b in blocks], repeats)
            exact_label, exact_ms = f"{kernel:.2f}", kernel
        else:
            exact_label, exact_ms = "-", dense
        out.append(
            f"| {label} | {m} | {exact_label} | {dense:.2f} | {fast:.2f} "
            f"| **{exact_ms / fast:.2f}x** |"
        )
        print(out[-1], flush=True)
    return out


def single_stream(engine: Engine, prompt: list[int], n: int) -> float:
    """Seconds of n decode steps of one request (the prefill cancels out)."""

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return Clock.measure(lambda: engine.generate([prompt], params)).wall

    return run(1 + n) - run(1)


def engine_rows(args: argparse.Namespace) -> list[str]:
    renderer = ChatRenderer(Tokenizer.from_source(resolve_model(DEFAULT_MODEL)))
    work = build_workload(renderer, args.num_prompts, args.max_output, args.seed)
    precisions = ("exact", "fast")
    rows = []
    for concurrency in args.concurrency:
        engines = {
            p: Engine(device="cpu", max_num_seqs=concurrency, cpu_precision=p) for p in precisions
        }
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in work.output_lens]  # fmt: skip
        prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        cases: dict[str, dict[str, list[float]]] = {}
        outputs: dict[str, list[list[int]]] = {}
        prompt_tokens = sum(map(len, work.prompts))
        for _ in range(args.repeats):
            for precision, engine in engines.items():
                times = cases.setdefault(precision, {})
                if concurrency == 1:
                    seconds = single_stream(engine, work.prompts[0], args.single_stream_tokens)
                    times.setdefault("decode", []).append(args.single_stream_tokens / seconds)
                else:
                    engine.reset_prefix_cache()
                    done: list[list[int]] = []
                    clock = Clock.measure(
                        lambda e=engine, d=done, p=params: d.extend(
                            c.token_ids for c in e.generate(work.prompts, p)
                        )
                    )
                    outputs[precision] = done
                    times.setdefault("throughput", []).append(work.useful_tokens / clock.wall)
                    engine.reset_prefix_cache()
                    clock = Clock.measure(lambda e=engine, p=prefill: e.generate(work.prompts, p))
                    times.setdefault("prefill", []).append(prompt_tokens / clock.wall)
                print(precision, concurrency, {k: v[-1] for k, v in times.items()}, flush=True)
        for case in cases["exact"]:
            exact = statistics.median(cases["exact"][case])
            fast = statistics.median(cases["fast"][case])
            same = "-"
            if case == "throughput":
                pairs = zip(outputs["exact"], outputs["fast"], strict=True)
                same = f"{sum(a == b for a, b in pairs)}/{len(work.prompts)}"
            what = {
                "decode": f"single-stream decode, {args.single_stream_tokens} tokens",
                "throughput": f"{concurrency} concurrent: {len(work.prompts)} prompts, "
                f"{work.useful_tokens} output tokens",
                "prefill": f"prefill of the {len(work.prompts)} prompts ({prompt_tokens} "
                f"tokens, {concurrency} at a time), tok/s of prompt",
            }[case]
            rows.append(f"| {what} | {exact:.1f} | {fast:.1f} | **{fast / exact:.2f}x** | {same} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--single-stream-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", nargs="+", default=["layers", "engine"],
                        choices=["layers", "engine"])  # fmt: skip
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not bf16_instructions():
        print("this CPU has no bf16 dot products: fast would run exact", file=sys.stderr)
    start_load = load_average()
    body = [
        "## cpu_precision",
        "",
        f"`{command_line()}`",
        "",
        f"Machine: {cpu_model()}; {machine()}; load average {start_load} at the start.",
    ]
    if "layers" in args.parts:
        engine = Engine(device="cpu")
        rows = layer_rows(engine, args.repeats)
        body += [
            "",
            "Per projection, ms per pass over all layers' weights (medians of "
            f"{args.repeats}): the GGUF kernel (exact decode, up to 96 rows), dense fp32 "
            "(exact prefill) and the bf16 copy (fast); the last column is exact's time "
            f"over fast's. fast keeps the kernel below {FAST_MIN_ROWS} rows.",
            "",
            "| projection | rows | kernel ms | dense fp32 ms | bf16 ms | exact / fast |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
        ]
        del engine
    if "engine" in args.parts:
        rows = engine_rows(args)
        body += [
            "",
            f"Engine, tok/s (medians of {args.repeats} alternating runs); outputs compared "
            "token for token.",
            "",
            "| case | exact tok/s | fast tok/s | fast / exact | fast's outputs as exact's |",
            "|---|---:|---:|---:|---:|",
            *rows,
        ]
    body.append(f"\nLoad average at the end: {load_average()}.")
    print("\n".join(body))
    if not args.no_write:
        write_section("cpu_precision", "\n".join(body))


if __name__ == "__main__":
    main()
