"""The GGUF CPU kernel (gpu_worker/ops/csrc/gguf_gemv.cpp) against dense fp32 `F.linear`.

    python -m bench.gguf_gemv [--threads 1] [--rows 1 2 4 8 16 32] [--no-write]
        [--parts smollm2 types engine]

Three parts, each kernel against dense fp32 in the same process, alternating:

`smollm2`: SmolLM2-135M's shapes with the weights of its GGUF file: the fused qkv (960 x 576),
o (576 x 576), fused gate_up (3072 x 576) and down (576 x 1536) projections in Q4_1, and the
tied LM head (49152 x 576) in Q8_0. Each timed pass runs one projection kind through all 30
layers' weights in turn, as decode does, so no layer's weights are still in L1/L2 when
they come round again (30 layers of fp32 are 0.4 GB, the LM head alone 113 MB; a large L3,
like the 480 MB a Sapphire Rapids VM may report, can still hold some).

`types`: every type the kernel reads (Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K) at the layer shapes of
a hidden-`--hidden` Llama (qkv, o, gate_up, down), `--layers` layers' worth of distinct
copies per pass (out of L3), at `--type-rows`; the weights are N(0, 1/k) quantized by
tests/helpers/kquants.py (gguf's quantizers for the per-32 types).

`engine`: single-stream greedy decode of a random Llama GGUF (`--engine-hidden`, written by
tests/helpers/kquants.py once per type, and a Q4_K_M-like mix) through the Engine with
the kernel on against the same file on dense fp32 weights (`cpu_gguf_kernels=False`),
timed as generate(1 + n) - generate(1) so that the prefill cancels out.

The tables give median times, their ratio, and the weight bytes each side streams per
second. Writes the `gguf_gemv` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from bench.common.machine import cpu_name, load_average
from bench.common.results_md import command_line, write_section
from bench.common.timing import timed
from gpu_worker.ops.gguf_linear import QuantizedWeight, load_extension
from shared.model_source import DEFAULT_MODEL, resolve_model
from tests.helpers.kquants import (
    one_type,
    q4_k_m_type,
    quantize,
    random_llama_tensors,
    write_llama_tensors,
)

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]

FUSED = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


Pair = tuple[QuantizedWeight, torch.Tensor]


def load_weights(path: Path) -> dict[str, list[Pair]]:
    """Projection kind -> per layer (quantized, dense fp32), plus the LM head."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def pair(names: list[str]) -> Pair:
        parts, dense = [], []
        for name in names:
            t = tensors[name]
            k, n = (int(d) for d in t.shape)
            parts.append(QuantizedWeight.from_gguf(t.data, int(t.tensor_type), (n, k)))
            dense.append(gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k))
        quant = QuantizedWeight.cat(parts)
        assert quant is not None
        return quant, torch.from_numpy(np.concatenate(dense).astype(np.float32))

    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    out = {
        kind: [pair([f"blk.{i}.{p}.weight" for p in parts]) for i in range(layers)]
        for kind, parts in FUSED.items()
    }
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out["lm_head"] = [pair([head])]
    return out


def compare(
    run_quant: Callable[[], object], run_dense: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median seconds of each side, timed alternately so that load changes hit both."""
    tq: list[float] = []
    td: list[float] = []
    for _ in range(repeats):
        tq += timed(run_quant, 1)
        td += timed(run_dense, 1)
    return statistics.median(tq), statistics.median(td)


def smollm2_table(args: argparse.Namespace, ext: ModuleType) -> list[str]:
    weights = load_weights(resolve_model(args.model).path)
    rows = [
        "| projection | rows | kernel ms | dense fp32 ms | dense / kernel "
        "| kernel GB/s | dense GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, pairs in weights.items():
        n, k = pairs[0][1].shape
        for m in args.rows:
            x = torch.randn(m, k)
            q_bytes = sum(q.data.numel() for q, _ in pairs)
            d_bytes = sum(d.numel() * 4 for _, d in pairs)

            def run_quant(x: torch.Tensor = x, pairs: list[Pair] = pairs) -> None:
                for q, _ in pairs:
                    ext.gemm(x, q.data, q.qtype, None)

            def run_dense(x: torch.Tensor = x, pairs: list[Pair] = pairs) -> None:
                for _, d in pairs:
                    F.linear(x, d)

            mq, md = compare(run_quant, run_dense, args.repeats)
            rows.append(
                f"| {kind} {n}x{k} x{len(pairs)} | {m} | {mq * 1e3:.3f} | {md * 1e3:.3f} "
                f"| **{md / mq:.2f}x** | {q_bytes / mq / 1e9:.1f} | {d_bytes / md / 1e9:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def layer_shapes(hidden: int) -> list[tuple[str, int, int]]:
    """(projection, n, k) of one layer of a Llama at `hidden` (head 128, 4:1 GQA, an MLP
    of 2.75x rounded to 256, as TinyLlama/Llama-3.2 shapes go)."""
    kv = hidden // 4
    inter = (hidden * 11 // 4 + 255) // 256 * 256
    return [
        ("qkv", hidden + 2 * kv, hidden),
        ("o", hidden, hidden),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]


def types_table(args: argparse.Namespace, ext: ModuleType) -> list[str]:
    shapes = layer_shapes(args.hidden)
    rng = np.random.default_rng(0)
    first = [
        rng.standard_normal((n, k), dtype=np.float32) * np.float32(k**-0.5) for _, n, k in shapes
    ]
    # Distinct copies per layer, so that a pass streams them from memory as decode does.
    dense = [torch.from_numpy(w).clone() for _ in range(args.layers) for w in first]
    d_bytes = sum(d.numel() * 4 for d in dense)
    weights = sum(n * k for _, n, k in shapes) * args.layers
    label = ", ".join(f"{name} {n}x{k}" for name, n, k in shapes)
    rows = [
        f"Layer shapes: {label}; {args.layers} layers a pass ({weights / 1e6:.0f} M weights, "
        f"{d_bytes / 1e9:.2f} GB in fp32).",
        "",
        "| type | bytes / weight | rows | kernel ms | dense fp32 ms | dense / kernel "
        "| kernel GB/s | dense GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for qtype in args.types:
        one = [QuantizedWeight.from_gguf(quantize(w, qtype), int(qtype), w.shape) for w in first]
        quant = [
            QuantizedWeight(q.data.clone(), q.qtype, q.k) for _ in range(args.layers) for q in one
        ]
        q_bytes = sum(q.data.numel() for q in quant)
        for m in args.type_rows:
            xs = {k: torch.randn(m, k) for k in {k for _, _, k in shapes}}

            def run_quant(
                xs: dict[int, torch.Tensor] = xs, quant: list[QuantizedWeight] = quant
            ) -> None:
                for q in quant:
                    ext.gemm(xs[q.k], q.data, q.qtype, None)

            def run_dense(xs: dict[int, torch.Tensor] = xs) -> None:
                for d in dense:
                    F.linear(xs[d.shape[1]], d)

            mq, md = compare(run_quant, run_dense, args.repeats)
            rows.append(
                f"| {qtype.name} | {q_bytes / weights:.3f} | {m} | {mq * 1e3:.2f} "
                f"| {md * 1e3:.2f} | **{md / mq:.2f}x** | {q_bytes / mq / 1e9:.1f} "
                f"| {d_bytes / md / 1e9:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def engine_table(args: argparse.Namespace, workdir: Path) -> list[str]:
    import transformers

    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    # The random files carry no tokenizer, so structured outputs (unused here) log why not.
    logging.getLogger("gpu_worker.sampling.structured").setLevel(logging.CRITICAL)
    hidden = args.engine_hidden
    kv = hidden // 4
    config = transformers.LlamaConfig(
        vocab_size=args.engine_vocab,
        hidden_size=hidden,
        intermediate_size=layer_shapes(hidden)[3][2],
        num_hidden_layers=args.engine_layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=kv // 128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    mixes: dict[str, Callable[[str], Q]] = {
        name: q4_k_m_type if name == "Q4_K_M" else one_type(gguf.GGMLQuantizationType[name])
        for name in args.engine_types
    }
    prompt = [(17 * i + 3) % args.engine_vocab for i in range(16)]
    n = args.engine_tokens
    rows = [
        f"Random Llama: hidden {hidden}, {args.engine_layers} layers, MLP "
        f"{config.intermediate_size}, {config.num_attention_heads}/{config.num_key_value_heads} "
        f"heads, vocabulary {args.engine_vocab} (untied head); one request, {len(prompt)}-token "
        f"prompt, {n} greedy tokens; medians of {args.engine_repeats}.",
        "",
        "| GGUF file | file MB | kernel tok/s | dense fp32 tok/s | kernel / dense |",
        "|---|---:|---:|---:|---:|",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=1 + n, ignore_eos=True)
    for name, qtype_of in mixes.items():
        path = workdir / f"random-llama.{name}.gguf"
        write_llama_tensors(config, random_llama_tensors(config), path, qtype_of)
        rates: dict[bool, list[float]] = {True: [], False: []}
        engines = {
            enabled: Engine(
                model=str(path),
                device="cpu",
                cpu_gguf_kernels=enabled,
                max_model_len=256,
                kv_cache_memory_gb=0.05,
            )
            for enabled in (True, False)
        }
        for engine in engines.values():
            engine.generate([prompt], full)  # first-call costs
        for _ in range(args.engine_repeats):
            for enabled, engine in engines.items():
                start = time.perf_counter()
                engine.generate([prompt], params)
                first = time.perf_counter() - start
                start = time.perf_counter()
                engine.generate([prompt], full)
                rates[enabled].append(n / (time.perf_counter() - start - first))
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        rows.append(
            f"| {name} | {path.stat().st_size / 1e6:.0f} | {on:.1f} | {off:.1f} "
            f"| **{on / off:.2f}x** |"
        )
        print(rows[-1], flush=True)
        del engines
        path.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["smollm2", "types", "engine"],
        choices=["smollm2", "types", "engine"],
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--types", type=Q.__getitem__, nargs="+", default=TYPES)
    parser.add_argument("--type-rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--engine-types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
    )
    parser.add_argument("--engine-hidden", type=int, default=2048)
    parser.add_argument("--engine-layers", type=int, default=4)
    parser.add_argument("--engine-vocab", type=int, default=32000)
    parser.add_argument("--engine-tokens", type=int, default=32)
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="a sentence for RESULTS.md (conditions)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_extension()
    if ext is None:
        sys.exit("the GGUF CPU kernels are not available (see the warning above)")
    load_before = load_average()
    sections: list[str] = []
    if "smollm2" in args.parts:
        sections += [
            "### SmolLM2-135M's GGUF (Q4_1 layers, Q8_0 head)",
            "",
            *smollm2_table(args, ext),
            "",
        ]
    if "types" in args.parts:
        sections += [f"### Every type at hidden {args.hidden}", "", *types_table(args, ext), ""]
    if "engine" in args.parts:
        with tempfile.TemporaryDirectory() as workdir:
            sections += [
                "### Engine single-stream decode per GGUF type",
                "",
                *engine_table(args, Path(workdir)),
                "",
            ]
    if args.no_write:
        return
    command = command_line()
    body = "\n".join(
        [
            "## gguf_gemv",
            "",
            f"`{command}`",
            "",
            f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s); load "
            f"average {load_before} at the start, {load_average()} at the end. Each kernel "
            "time is one pass over all layers' weights of that projection (out of L1/L2); "
            f"medians of {args.repeats}, both sides alternating in one process. {args.note}",
            "",
            *sections,
        ]
    )
    write_section("gguf_gemv", body)


if __name__ == "__main__":
    main()
