"""Triton attention kernels on a GPU, against baselines measured in the same run.

    python -m bench.kernels [--quick]

Decode (`kernels.paged_attention.paged_decode_attention`): batch 1, 32, 256 x context 1k, 8k,
32k; bf16, 32 query heads over 8 KV heads, head_dim 128, block size 16, blocks in random order.
  - achieved bandwidth (K/V bytes read / time) as a fraction of a device-to-device copy's
    (bytes read + written / time) on a 2 GiB buffer;
  - time against `F.scaled_dot_product_attention` on the same K/V gathered per sequence (the
    fastest SDPA backend that accepts the shapes; never the math fallback).
Prefill (`kernels.prefill_attention.paged_prefill_attention`): causal TFLOP/s (only the visible
query-key pairs counted) against SDPA on the same shapes, K/V expanded to all heads for it.

Kernels are timed as CUDA-graph replays (`triton.testing.do_bench_cudagraph`), as the engine runs
decode: CPU launch overhead is left out on both sides. Small decode cases fit in L2 and are
marked so. Writes the `kernels` section of bench/RESULTS.md, and `$OUT/kernels.json` when OUT
is set. Needs a CUDA GPU. The engine on the GPU is bench/gpu_engine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.results_md import command_line, write_section

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_TARGET = 0.70  # of copy bandwidth, at batch >= 32 and context >= 8k
PREFILL_TARGET = 1 / 1.5  # of SDPA's TFLOP/s: within 1.5x of its time (issue 22)


@dataclass
class DecodeResult:
    """One decode shape: our kernel against the copy ceiling and SDPA."""

    batch: int
    context: int
    num_splits: int
    config: str
    us: float
    gbps: float
    copy_fraction: float
    sdpa_us: float | None
    sdpa_backend: str
    speedup_vs_sdpa: float | None
    max_abs_err: float | None
    fits_in_l2: bool


@dataclass
class PrefillResult:
    """One prefill shape: our kernel against SDPA, in causal TFLOP/s."""

    name: str
    num_seqs: int
    query_len: int
    prefix_len: int
    config: str
    ms: float
    tflops: float
    sdpa_ms: float | None
    sdpa_tflops: float | None
    sdpa_backend: str
    ratio_vs_sdpa: float | None
    max_abs_err: float | None


def measure_ms(fn: Callable[[], object]) -> float:
    """Median of CUDA-graph replays; the first call outside the graph compiles and autotunes."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second, on buffers far beyond L2.

    Timed as plain launches, not a graph replay: captured in a CUDA graph the copy becomes a
    memcpy node that the copy engine serves (2.7 TB/s on an H200 against 4.3 TB/s for the
    copy kernel), which would flatter every kernel measured against it."""
    import triton.testing

    n = 2 << 30
    src = torch.empty(n // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median"))
    return 2 * n / (ms * 1e-3)


def fastest_sdpa(q, k, v, **kwargs) -> tuple[Callable[[], torch.Tensor] | None, str, float | None]:
    """Time each non-math SDPA backend that accepts the inputs; return the fastest."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best: tuple[Callable[[], torch.Tensor] | None, str, float | None] = (None, "none", None)
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ):

        def run(backend=backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

        try:
            ms = measure_ms(run)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            print(f"    sdpa {backend.name}: unavailable ({str(exc).splitlines()[0][:80]})")
            torch.cuda.synchronize()
            continue
        if best[2] is None or ms < best[2]:
            best = (run, backend.name.lower(), ms)
    return best


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def random_tables(num_seqs: int, blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    """Block tables over a pool of exactly the blocks needed, handed out in random order."""
    order = torch.randperm(num_seqs * blocks_per_seq, device=device, dtype=torch.int64)
    return order.view(num_seqs, blocks_per_seq).to(torch.int32)


def bench_decode(
    batch: int, context: int, copy_bps: float, l2_bytes: int, device: torch.device
) -> DecodeResult:
    from kernels import paged_attention

    blocks_per_seq = context // BLOCK_SIZE
    shape = (2, batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    tables = random_tables(batch, blocks_per_seq, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    scale = HEAD_DIM**-0.5

    def ours() -> torch.Tensor:
        return paged_attention.paged_decode_attention(q, kv_cache, tables, seq_lens, scale)

    ms = measure_ms(ours)
    out = ours()
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    max_context = tables.shape[1] * BLOCK_SIZE
    split_size = paged_attention.choose_split_size(
        batch, NUM_KV_HEADS, max_context, paged_attention.PROGRAMS_PER_SM * num_sms(device)
    )
    num_splits = -(-max_context // split_size)
    config = str(getattr(paged_attention._paged_decode_kernel_tuned, "best_config", ""))

    # SDPA on the same K/V gathered per sequence: [batch, kv_heads, context, dim] views.
    sdpa_run = sdpa_ms = None
    backend, err = "none", None
    try:
        rows = tables.long()
        keys = kv_cache[0][rows].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        values = kv_cache[1][rows].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        sdpa_run, backend, sdpa_ms = fastest_sdpa(
            q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True
        )
        if sdpa_run is not None:
            err = (sdpa_run().squeeze(2).float() - out.float()).abs().max().item()
    except torch.OutOfMemoryError:
        backend = "out of memory"
    return DecodeResult(
        batch=batch,
        context=context,
        num_splits=num_splits,
        config=config,
        us=ms * 1e3,
        gbps=gbps,
        copy_fraction=gbps * 1e9 / copy_bps,
        sdpa_us=None if sdpa_ms is None else sdpa_ms * 1e3,
        sdpa_backend=backend,
        speedup_vs_sdpa=None if sdpa_ms is None else sdpa_ms / ms,
        max_abs_err=err,
        fits_in_l2=kv_bytes < l2_bytes,
    )


def bench_prefill(
    name: str, num_seqs: int, query_len: int, prefix_len: int, device: torch.device
) -> PrefillResult:
    from torch.nn.attention.bias import causal_lower_right

    from kernels import prefill_attention

    seq_len = prefix_len + query_len
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    shape = (2, num_seqs * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    tables = random_tables(num_seqs, blocks_per_seq, device)
    q = torch.randn(num_seqs * query_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    query_start_loc = i32([i * query_len for i in range(num_seqs + 1)])
    seq_lens, context_lens = i32([seq_len] * num_seqs), i32([prefix_len] * num_seqs)
    scale = HEAD_DIM**-0.5

    def ours() -> torch.Tensor:
        return prefill_attention.paged_prefill_attention(
            q, kv_cache, tables, query_start_loc, seq_lens, context_lens, query_len, scale
        )

    ms = measure_ms(ours)
    out = ours()
    pairs = num_seqs * (query_len * prefix_len + query_len * (query_len + 1) // 2)
    flops = 4 * HEAD_DIM * NUM_HEADS * pairs  # QK^T and PV, 2 flops per multiply-add
    config = str(getattr(prefill_attention._paged_prefill_kernel_tuned, "best_config", ""))

    group = NUM_HEADS // NUM_KV_HEADS
    rows = tables.long()
    dense = (num_seqs, blocks_per_seq * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    keys = kv_cache[0][rows].view(dense)[:, :seq_len].transpose(1, 2)
    values = kv_cache[1][rows].view(dense)[:, :seq_len].transpose(1, 2)
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    q_sdpa = q.view(num_seqs, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    mask: dict[str, object]
    if prefix_len:
        mask = {"attn_mask": causal_lower_right(query_len, seq_len)}
    else:
        mask = {"is_causal": True}
    sdpa_run, backend, sdpa_ms = fastest_sdpa(q_sdpa, keys, values, scale=scale, **mask)
    err = None
    if sdpa_run is not None:
        expected = sdpa_run().transpose(1, 2).reshape(out.shape)
        err = (expected.float() - out.float()).abs().max().item()
    tflops = flops / (ms * 1e-3) / 1e12
    sdpa_tflops = None if sdpa_ms is None else flops / (sdpa_ms * 1e-3) / 1e12
    return PrefillResult(
        name=name,
        num_seqs=num_seqs,
        query_len=query_len,
        prefix_len=prefix_len,
        config=config,
        ms=ms,
        tflops=tflops,
        sdpa_ms=sdpa_ms,
        sdpa_tflops=sdpa_tflops,
        sdpa_backend=backend,
        ratio_vs_sdpa=None if sdpa_tflops is None else tflops / sdpa_tflops,
        max_abs_err=err,
    )


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render(device_name: str, command: str, copy_bps: float, decode, prefill) -> str:
    lines = [
        "## Triton kernels (bench/kernels.py)",
        "",
        f"Command: `{command}` on {device_name}, torch {torch.__version__}, "
        f"triton {_triton_version()}. {str(DTYPE).removeprefix('torch.')}, "
        f"{NUM_HEADS} query / {NUM_KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, block size {BLOCK_SIZE}; times are medians of CUDA-graph "
        f"replays. Device-to-device copy: {copy_bps / 1e9:,.0f} GB/s (read + write).",
        "",
        f"### Decode (`paged_decode_attention`), target >= {DECODE_TARGET:.0%} of copy "
        "bandwidth at batch >= 32 and context >= 8k",
        "",
        "| batch | context | splits | us | GB/s | of copy | SDPA us (backend) | vs SDPA "
        "| max abs err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        note = " (in L2)" if r.fits_in_l2 else ""
        target = r.batch >= 32 and r.context >= 8192
        mark = (" ✓" if r.copy_fraction >= DECODE_TARGET else " ✗") if target else ""
        lines.append(
            f"| {r.batch} | {r.context} | {r.num_splits} | {r.us:,.1f} | {r.gbps:,.0f}{note} "
            f"| {r.copy_fraction:.0%}{mark} | {_fmt(r.sdpa_us, ',.1f')} ({r.sdpa_backend}) "
            f"| {_fmt(r.speedup_vs_sdpa, '.2f')}x | {_fmt(r.max_abs_err, '.1e')} |"
        )
    lines += [
        "",
        f"### Prefill (`paged_prefill_attention`), target >= {PREFILL_TARGET:.2f}x SDPA "
        "(within 1.5x of its time)",
        "",
        "| case | seqs x new tokens | prefix | ms | TFLOP/s | SDPA TFLOP/s (backend) "
        "| vs SDPA | max abs err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in prefill:
        ok = r.ratio_vs_sdpa is not None and r.ratio_vs_sdpa >= PREFILL_TARGET
        mark = "" if r.ratio_vs_sdpa is None else (" ✓" if ok else " ✗")
        lines.append(
            f"| {r.name} | {r.num_seqs} x {r.query_len} | {r.prefix_len} | {r.ms:.3f} "
            f"| {r.tflops:.0f} | {_fmt(r.sdpa_tflops, '.0f')} ({r.sdpa_backend}) "
            f"| {_fmt(r.ratio_vs_sdpa, '.2f')}x{mark} | {_fmt(r.max_abs_err, '.1e')} |"
        )
    configs = sorted({r.config for r in [*decode, *prefill] if r.config})
    if configs:
        lines += ["", "Autotuned configs seen: " + "; ".join(f"`{c}`" for c in configs)]
    return "\n".join(lines) + "\n"


def _triton_version() -> str:
    import triton

    return triton.__version__


def run_kernels(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Decode and prefill kernels; writes the `kernels` section, returns the JSON payload."""
    props = torch.cuda.get_device_properties(device)
    device_name = torch.cuda.get_device_name(device)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(device)
    print(f"{device_name}: copy {copy_bps / 1e9:,.0f} GB/s", flush=True)

    batches = (1, 32) if args.quick else (1, 32, 256)
    contexts = (1024, 8192) if args.quick else (1024, 8192, 32768)
    decode = []
    for batch in batches:
        for context in contexts:
            result = bench_decode(batch, context, copy_bps, l2_bytes, device)
            decode.append(result)
            print(
                f"decode b={batch:<4} ctx={context:<6} {result.us:9.1f} us "
                f"{result.copy_fraction:5.0%} of copy, {_fmt(result.speedup_vs_sdpa, '.2f')}x "
                f"SDPA ({result.sdpa_backend}), err {_fmt(result.max_abs_err, '.1e')}",
                flush=True,
            )
            torch.cuda.empty_cache()

    prefill_cases = [
        ("1k", 1, 1024, 0),
        ("4k", 1, 4096, 0),
        ("4 x 2k", 4, 2048, 0),
        ("2k chunk on 6k prefix", 1, 2048, 6144),
    ]
    if not args.quick:
        prefill_cases.insert(2, ("16k", 1, 16384, 0))
    prefill = []
    for case in prefill_cases:
        case_result = bench_prefill(*case, device)
        prefill.append(case_result)
        print(
            f"prefill {case_result.name:<24} {case_result.ms:8.3f} ms "
            f"{case_result.tflops:5.0f} TFLOP/s, "
            f"{_fmt(case_result.ratio_vs_sdpa, '.2f')}x SDPA ({case_result.sdpa_backend}), "
            f"err {_fmt(case_result.max_abs_err, '.1e')}",
            flush=True,
        )
        torch.cuda.empty_cache()

    section = render(device_name, command_line(), copy_bps, decode, prefill)
    write_section("kernels", section)
    return {
        "kernels_section": section,
        "copy_gbps": copy_bps / 1e9,
        "decode": [asdict(r) for r in decode],
        "prefill": [asdict(r) for r in prefill],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 32, contexts 1k, 8k")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU: the Triton kernels run only there.")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter is for CPU tests, not for timing.")
        return 2
    device = torch.device("cuda")
    payload: dict[str, object] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        **run_kernels(args, device),
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "kernels.json").write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
