"""duet's CPU kernels (gpu_worker/ops/csrc/cpu_ops.cpp) against the torch paths they replace.

    python bench/cpu_ops.py [--threads 1] [--repeats 15] [--no-write]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hidden 576, 30 layers,
16-token blocks). Attention times a decode step's attention over all 30 layers:
`TorchAttentionBackend.forward` (KV write included) with the kernels and with them off
(today's torch path: per-step plan, block gather, SDPA), each layer with its own cache and
the sequences' blocks shuffled, as after a while of serving. The KV write and RMSNorm rows
time one call. Both sides run in one process, alternating; the table gives median times
and their ratio. Writes the `cpu_ops` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf_gemv import timed
from results_md import write_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.attention import torch_backend as attention  # noqa: E402
from gpu_worker.attention.metadata import build_attention_metadata  # noqa: E402
from gpu_worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from gpu_worker.ops import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, BLOCK = 9, 3, 64, 576, 30, 16
EPS = 1e-5


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed(fn, repeats)) * 1e3


def compare(
    kernel: Callable[[], object], torch_path: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """(torch ms, kernel ms), alternating so that both see the same machine."""
    k_times, t_times = [], []
    for _ in range(3):
        t_times.append(median_ms(torch_path, repeats))
        k_times.append(median_ms(kernel, repeats))
    return statistics.median(t_times), statistics.median(k_times)


def attention_case(num_seqs: int, context: int, repeats: int) -> tuple[float, float]:
    """A decode step's attention over 30 layers; each sequence holds `context` tokens."""
    gen = torch.Generator().manual_seed(num_seqs * 1000 + context)
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = num_seqs * per_seq + 8
    caches = [
        torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
        for _ in range(LAYERS)
    ]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
    q = torch.randn((num_seqs, HEADS, HEAD_DIM), generator=gen)
    k = torch.randn((num_seqs, KV_HEADS, HEAD_DIM), generator=gen)
    v = torch.randn((num_seqs, KV_HEADS, HEAD_DIM), generator=gen)
    backend = TorchAttentionBackend()

    def step() -> None:
        # A fresh metadata and plan per step, as the model runner makes them.
        meta = build_attention_metadata([1] * num_seqs, [context] * num_seqs, tables, BLOCK)
        backend.plan(meta, caches[0])
        for cache in caches:
            backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)

    available = cpu_ops.available

    def with_kernel() -> None:
        attention.cpu_ops.available = available  # type: ignore[method-assign]
        step()

    def without_kernel() -> None:
        attention.cpu_ops.available = lambda t: False  # type: ignore[method-assign]
        step()

    try:
        return compare(with_kernel, without_kernel, repeats)
    finally:
        attention.cpu_ops.available = available  # type: ignore[method-assign]


def write_kv_case(tokens: int, repeats: int) -> tuple[float, float]:
    """One layer's KV write; k/v are row-strided views of the QKV output, as in the model."""
    cache = torch.zeros((2, 3000, BLOCK, KV_HEADS, HEAD_DIM))
    qkv = torch.randn((tokens, HEADS + 2 * KV_HEADS, HEAD_DIM))
    k, v = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    slots = torch.randperm(3000 * BLOCK)[:tokens]
    flat = [cache[i].view(-1, KV_HEADS, HEAD_DIM) for i in (0, 1)]

    def torch_path() -> None:
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    return compare(
        lambda: [cpu_ops.write_kv(k, v, cache, slots) for _ in range(100)],
        lambda: [torch_path() for _ in range(100)],
        repeats,
    )


def rms_case(tokens: int, fused_add: bool, repeats: int) -> tuple[float, float]:
    """100 calls of rms_norm (or add + rms_norm) against F.rms_norm (the model's fp32 op)."""
    x = torch.randn((tokens, HIDDEN))
    residual = torch.randn((tokens, HIDDEN))
    weight = torch.randn(HIDDEN)
    if fused_add:

        def kernel() -> object:
            return [cpu_ops.add_rms_norm(x, residual, weight, EPS) for _ in range(100)]

        def torch_path() -> object:
            out = []
            for _ in range(100):
                new = residual + x
                out.append((F.rms_norm(new, weight.shape, weight, EPS), new))
            return out

    else:

        def kernel() -> object:
            return [cpu_ops.rms_norm(x, weight, EPS) for _ in range(100)]

        def torch_path() -> object:
            return [F.rms_norm(x, weight.shape, weight, EPS) for _ in range(100)]

    return compare(kernel, torch_path, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.available(torch.zeros(1)):
        sys.exit("the duet CPU kernels are not available here")

    rows: list[tuple[str, str, float, float]] = []
    for num_seqs, context in [(1, 150), (1, 1000), (8, 150), (32, 150), (32, 500)]:
        torch_ms, kernel_ms = attention_case(num_seqs, context, max(3, args.repeats // 3))
        rows.append(("decode attention, 30 layers", f"{num_seqs} x {context}", torch_ms, kernel_ms))
        print(rows[-1], flush=True)
    for tokens in (1, 32):
        torch_ms, kernel_ms = write_kv_case(tokens, args.repeats)
        rows.append(("write_kv, 100 calls", f"{tokens} tokens", torch_ms, kernel_ms))
        print(rows[-1], flush=True)
    for fused in (False, True):
        for tokens in (1, 32):
            torch_ms, kernel_ms = rms_case(tokens, fused, args.repeats)
            name = "add_rms_norm" if fused else "rms_norm"
            rows.append((f"{name}, 100 calls", f"{tokens} x {HIDDEN}", torch_ms, kernel_ms))
            print(rows[-1], flush=True)

    cpu = platform.processor() or platform.machine()
    lines = [
        "## CPU kernels (`bench/cpu_ops.py`)",
        "",
        f"`python bench/cpu_ops.py --threads {args.threads}` on {cpu}"
        f" ({torch.get_num_threads()} torch thread(s), torch {torch.__version__}). Torch side:"
        " attention = `TorchAttentionBackend` with the kernels off (plan, block gather, SDPA,"
        " `index_copy_` KV write); write_kv = two `index_copy_`; RMSNorm = `F.rms_norm`"
        " (plus `residual + x`). SmolLM2-135M shapes; median ms.",
        "",
        "| op | shape | torch ms | kernel ms | speedup |",
        "|---|---|---:|---:|---:|",
    ]
    for op, shape, torch_ms, kernel_ms in rows:
        lines.append(
            f"| {op} | {shape} | {torch_ms:.3f} | {kernel_ms:.3f} | {torch_ms / kernel_ms:.2f}x |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("cpu_ops", body)


if __name__ == "__main__":
    main()
