"""The GGUF CPU kernel (gpu_worker/ops/csrc/gguf_gemv.cpp) against dense fp32 `F.linear`.

    python bench/gguf_gemv.py [--threads 1] [--rows 1 2 4 8 16 32] [--no-write]

Shapes are SmolLM2-135M's, with the weights of its GGUF file: the fused qkv (960 x 576),
o (576 x 576), fused gate_up (3072 x 576) and down (576 x 1536) projections in Q4_1, and the
tied LM head (49152 x 576) in Q8_0. Each timed pass runs one projection kind through all 30
layers' weights in turn, as decode does, so no layer's weights are still in L1/L2 when
they come round again (30 layers of fp32 are 0.4 GB, the LM head alone 113 MB; a large L3,
like the 480 MB a Sapphire Rapids VM may report, can still hold some). Both sides run in
one process, alternating, and the table gives median times, their ratio, and the weight
bytes each side streams per second. Writes the `gguf_gemv` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from results_md import command_line, write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.ops.gguf_linear import QuantizedWeight, load_extension  # noqa: E402
from shared.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402

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


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_extension()
    if ext is None:
        sys.exit("the GGUF CPU kernels are not available (see the warning above)")
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

            tq: list[float] = []
            td: list[float] = []
            for _ in range(args.repeats):  # alternate, so load changes hit both sides
                tq += timed(run_quant, 1)
                td += timed(run_dense, 1)
            mq, md = statistics.median(tq), statistics.median(td)
            rows.append(
                f"| {kind} {n}x{k} x{len(pairs)} | {m} | {mq * 1e3:.3f} | {md * 1e3:.3f} "
                f"| **{md / mq:.2f}x** | {q_bytes / mq / 1e9:.1f} | {d_bytes / md / 1e9:.1f} |"
            )
            print(rows[-1], flush=True)
    if args.no_write:
        return
    command = command_line()
    body = "\n".join(
        [
            "## gguf_gemv",
            "",
            f"`{command}`",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s). Each "
            "time is one pass over all layers' weights of that projection (out of L1/L2); "
            f"medians of {args.repeats}, both sides alternating in one process.",
            "",
            *rows,
        ]
    )
    write_section("gguf_gemv", body)


if __name__ == "__main__":
    main()
