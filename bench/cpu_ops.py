"""duet's CPU kernels (gpu_worker/ops/csrc/cpu_ops.cpp) against the torch paths they replace.

    python -m bench.cpu_ops [--threads 1] [--repeats 15] [--no-write]
    python -m bench.cpu_ops --kv-dtypes --threads 2   # --kv-cache-dtype: fp32, bf16, fp16

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, hidden 576, 30 layers,
16-token blocks). Attention times a decode step's attention over all 30 layers:
`TorchAttentionBackend.forward` (KV write included) with the kernels and with them off
(today's torch path: per-step plan, block gather, SDPA), each layer with its own cache and
the sequences' blocks shuffled, as after a while of serving. The KV write and RMSNorm rows
time one call. Both sides run in one process, alternating; the table gives median times
and their ratio. Writes the `cpu_ops` section of bench/RESULTS.md.

`--kv-dtypes` instead measures the KV cache's dtype (`--kv-cache-dtype`): single-stream
decode of the built-in model (SmolLM2-135M, fp32 weights, the CPU GGUF kernels) over a
context of 1k and 8k tokens of README.md, one Engine per cache dtype, tok/s as
generate(1 + n) - generate(1) with the prompt in the prefix cache (so the prefill cancels
out), the engines taking turns `--repeats` times; and the decode attention kernel alone
(30 layers, one sequence) over a cache of each dtype. Ratios are against fp32 in the same
run. Writes the `kv_cache_dtype` section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common.machine import cpu_model, cpu_name, load_average
from bench.common.results_md import BENCH_DIR, command_line, write_section
from bench.common.timing import median_ms
from gpu_worker.attention import torch_backend as attention
from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.ops import cpu_ops
from gpu_worker.ops.gguf_linear import load_extension

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, BLOCK = 9, 3, 64, 576, 30, 16
EPS = 1e-5


def compare(
    kernel: Callable[[], object], torch_path: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """(torch ms, kernel ms), alternating so that both see the same machine."""
    k_times, t_times = [], []
    for _ in range(3):
        t_times.append(median_ms(torch_path, repeats))
        k_times.append(median_ms(kernel, repeats))
    return statistics.median(t_times), statistics.median(k_times)


def attention_case(
    num_seqs: int, context: int, repeats: int, cache_dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """A decode step's attention over 30 layers; each sequence holds `context` tokens."""
    gen = torch.Generator().manual_seed(num_seqs * 1000 + context)
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = num_seqs * per_seq + 8
    caches = [
        torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(cache_dtype)
        for _ in range(LAYERS)
    ]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
    q = torch.randn((num_seqs, HEADS, HEAD_DIM), generator=gen)
    k = torch.randn((num_seqs, KV_HEADS, HEAD_DIM), generator=gen)
    v = torch.randn((num_seqs, KV_HEADS, HEAD_DIM), generator=gen)
    backend = TorchAttentionBackend(torch.float32)

    def step() -> None:
        # A fresh metadata and plan per step, as the model runner makes them.
        meta = build_attention_metadata([1] * num_seqs, [context] * num_seqs, tables, BLOCK)
        backend.plan(meta, caches[0])
        for cache in caches:
            backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)

    # The backend's kernels, on or off: off is the torch path where the extension is absent.
    kernels: Any = attention.cpu_ops

    def with_kernel() -> None:
        kernels.load_extension = load_extension
        step()

    def without_kernel() -> None:
        kernels.load_extension = lambda: None
        step()

    try:
        return compare(with_kernel, without_kernel, repeats)
    finally:
        kernels.load_extension = load_extension


def write_kv_case(tokens: int, repeats: int) -> tuple[float, float]:
    """One layer's KV write; k/v are row-strided views of the QKV output, as in the model."""
    cache = torch.zeros((2, 3000, BLOCK, KV_HEADS, HEAD_DIM))
    qkv = torch.randn((tokens, HEADS + 2 * KV_HEADS, HEAD_DIM))
    k, v = qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    slots = torch.randperm(3000 * BLOCK)[:tokens]
    flat = [cache[i].view(-1, KV_HEADS, HEAD_DIM) for i in (0, 1)]

    def kernel() -> None:
        for _ in range(100):
            cpu_ops.write_kv(k, v, cache, slots)

    def torch_path() -> None:
        for _ in range(100):
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)

    return compare(kernel, torch_path, repeats)


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


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CONTEXTS = (1000, 8000)


def readme_tokens(count: int) -> list[int]:
    """The first `count` tokens of README.md under the built-in model's tokenizer: prose,
    tables and code, so attention has real text to look at."""
    from render_server.templating.tokenizer import Tokenizer
    from shared.model_source import DEFAULT_MODEL, resolve_model

    text = (BENCH_DIR.parent / "README.md").read_text()
    tokens = Tokenizer.from_source(resolve_model(DEFAULT_MODEL)).encode(text)
    if len(tokens) < count:
        sys.exit(f"README.md has {len(tokens)} tokens, fewer than the {count} asked for")
    return tokens[:count]


def decode_rate(engine: Any, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s after `prompt`: generate(1 + n) - generate(1), the prompt's blocks in
    the prefix cache for both, so only the n decode steps differ."""
    from shared.sampling import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([prompt], params)
        return time.perf_counter() - start

    first = run(1)
    return new_tokens / (run(1 + new_tokens) - first)


def kv_dtypes(args: argparse.Namespace) -> None:
    """Single-stream decode per KV cache dtype at 1k and 8k contexts, and the attention
    kernel alone; the `kv_cache_dtype` section of RESULTS.md."""
    from gpu_worker import Engine

    load_at_start = load_average()
    tokens = readme_tokens(max(KV_CONTEXTS))
    engines = {
        name: Engine(device="cpu", kv_cache_dtype=name, max_num_seqs=1, max_model_len=8192)
        for name in KV_DTYPES
    }
    rates: dict[tuple[int, str], list[float]] = {}
    for context in KV_CONTEXTS:
        prompt = tokens[:context]
        for engine in engines.values():  # prefill once; every later run hits the cache
            decode_rate(engine, prompt, 1)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                rate = decode_rate(engine, prompt, args.decode_tokens)
                rates.setdefault((context, name), []).append(rate)
                print(f"context {context}, {name} cache: {rate:.1f} tok/s", flush=True)
    for engine in engines.values():
        engine.close()
    kernel_ms: dict[tuple[int, str], float] = {}
    for context in KV_CONTEXTS:
        for name, dtype in KV_DTYPES.items():
            kernel, _ = attention_case(1, context, max(3, args.repeats), dtype)
            kernel_ms[(context, name)] = kernel
            print(f"attention kernel, context {context}, {name}: {kernel:.3f} ms", flush=True)

    lines = [
        "## KV cache dtype (`bench/cpu_ops.py --kv-dtypes`)",
        "",
        f"`{command_line()}` on {cpu_model()}, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}; load average {load_at_start} at the start, "
        f"{load_average()} at the end (2 cores, shared with other jobs: medians of "
        f"{args.repeats} turns). SmolLM2-135M-Instruct (fp32 weights, CPU GGUF kernels), one "
        f"request decoding {args.decode_tokens} tokens after 1k or 8k tokens of README.md, "
        "timed as generate(1 + n) - generate(1) with the prompt in the prefix cache. "
        "Attention kernel: `TorchAttentionBackend.forward` of one decode step over 30 "
        "layers' caches (KV write included), SmolLM2's shapes, the blocks shuffled as after "
        "a while of serving (the engine's lone request has its blocks in order).",
        "",
        "Best: each dtype's fastest turn, the one least disturbed by other jobs.",
        "",
        "| context | KV cache | decode tok/s, median | vs fp32 | best | vs fp32 "
        "| attention kernel ms | vs fp32 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for context in KV_CONTEXTS:
        base_rate = statistics.median(rates[(context, "float32")])
        base_best = max(rates[(context, "float32")])
        base_ms = kernel_ms[(context, "float32")]
        for name in KV_DTYPES:
            rate = statistics.median(rates[(context, name)])
            best = max(rates[(context, name)])
            ms = kernel_ms[(context, name)]
            lines.append(
                f"| {context} | {name} | {rate:.1f} | {rate / base_rate:.2f}x | {best:.1f} | "
                f"{best / base_best:.2f}x | {ms:.3f} | {base_ms / ms:.2f}x |"
            )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("kv_cache_dtype", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--kv-dtypes", action="store_true", help="decode per --kv-cache-dtype instead"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=64, help="--kv-dtypes: tokens decoded per run"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.available(torch.zeros(1)):
        sys.exit("the duet CPU kernels are not available here")
    if args.kv_dtypes:
        kv_dtypes(args)
        return

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

    cpu = cpu_name()
    lines = [
        "## CPU kernels (`bench/cpu_ops.py`)",
        "",
        f"`{command_line(['--threads', str(args.threads)])}` on {cpu}"
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
