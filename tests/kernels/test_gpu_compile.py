"""Every kernel compiles for Hopper (sm_90) here, without a GPU.

The interpreter runs kernels as numpy and skips Triton's compiler, so it cannot catch what only
compilation checks: types of loop-carried values, dot shapes and dtypes, constexpr rules. This
test compiles each kernel down to a cubin with the ptxas bundled in Triton's wheel, in a
subprocess without TRITON_INTERPRET (decoration there must produce real JIT functions).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import (
    activation, cache_ops, fused_moe, lora, paged_attention, prefill_attention, rms_norm, rotary,
)

POINTER_TYPES = {
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "context_lens_ptr": "*i32", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64",
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
}
FLOAT_ARGS = {"scale_log2", "eps"}


def build(kernel, dtype, num_warps=4, num_stages=3, pointers=None, **consts):
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            types = {**POINTER_TYPES, **(pointers or {})}
            signature[name] = types.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
        if name in fn.do_not_specialize:
            continue
        if name.endswith("_ptr") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # as a real launch specializes them
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled", fn.__name__, dtype, flush=True)
    return compiled.asm["ttgir"]


# K/V shared-memory buffers (the leading dim of the 3-D bf16 memdescs) and the largest number
# of copy groups an async_wait leaves in flight.
def pipelining(ttgir):
    buffers = {int(n) for n in re.findall(r"memdesc<(\d+)x\d+x\d+xbf16", ttgir)}
    waits = [int(n) for n in re.findall(r"async_wait[^{\n]*\{num = (\d+)", ttgir)]
    return max(buffers, default=0), max(waits, default=0)


# Every autotune config of both attention kernels, as the autotuner would launch them (the
# prefill pruning: 8 warps for 128-row tiles, 4 for 32-row ones).
decode = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, PAGE_SIZE=16, DOT_PRECISION=None)
for config in paged_attention._DECODE_CONFIGS:
    ttgir = build(paged_attention._paged_decode_kernel, "bf16", config.num_warps,
                  config.num_stages, SINGLE_SPLIT=False, HAS_WINDOW=False, SOFTCAP=0.0,
                  **decode, **config.kwargs)
    print("decode pipeline", config.num_stages, *pipelining(ttgir), flush=True)
prefill = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, PAGE_SIZE=16, DOT_PRECISION=None)
for config in prefill_attention._PREFILL_CONFIGS:
    rows = 128 if config.num_warps == 8 else 32
    ttgir = build(prefill_attention._paged_prefill_kernel, "bf16", config.num_warps,
                  config.num_stages, BLOCK_M=rows, BLOCK_Q=rows // 4, HAS_WINDOW=False,
                  SOFTCAP=0.0, **prefill, **config.kwargs)
    print("prefill pipeline", config.num_stages, *pipelining(ttgir), flush=True)

decode = dict(decode, BLOCK_N=64)
# SOFTCAP 0 is off; Gemma 2's attention cap is 50.
for splits, window, softcap in ((1, False, 0.0), (4, False, 0.0), (1, True, 0.0),
                                (4, True, 0.0), (1, False, 50.0), (4, True, 50.0)):
    ttgir = build(paged_attention._paged_decode_kernel, "bf16", SINGLE_SPLIT=splits == 1,
                  HAS_WINDOW=window, SOFTCAP=softcap, **decode)
    print("decode-variant pipeline 3", *pipelining(ttgir), flush=True)
build(paged_attention._combine_splits_kernel, "bf16", SPLITS_PAD=8, HEAD_DIM=128)
# int64 lengths (a caller's `.long()`), which the kernels accept: loop-carried offsets must
# keep one type whichever width the lengths load with (the H200's first run caught this).
wide = {"seq_lens_ptr": "*i64", "context_lens_ptr": "*i64", "query_start_loc_ptr": "*i64"}
for splits in (1, 4):
    build(paged_attention._paged_decode_kernel, "fp16", pointers=wide, SINGLE_SPLIT=splits == 1,
          HAS_WINDOW=False, SOFTCAP=0.0, **dict(decode, GROUP=2, HEAD_DIM=64))
build(paged_attention._combine_splits_kernel, "fp16", pointers=wide, SPLITS_PAD=2, HEAD_DIM=64)
prefill = dict(prefill, BLOCK_N=64)
build(prefill_attention._paged_prefill_kernel, "bf16", 8, pointers=wide, BLOCK_M=128,
      BLOCK_Q=32, HAS_WINDOW=True, SOFTCAP=0.0, **prefill)
for window in (False, True):
    build(prefill_attention._paged_prefill_kernel, "bf16", 8, BLOCK_M=128, BLOCK_Q=32,
          HAS_WINDOW=window, SOFTCAP=0.0, **prefill)
    build(prefill_attention._paged_prefill_kernel, "fp16", 4, BLOCK_M=16, BLOCK_Q=4,
          HAS_WINDOW=window, SOFTCAP=0.0, **prefill)
    build(prefill_attention._paged_prefill_kernel, "bf16", 8, BLOCK_M=128, BLOCK_Q=32,
          HAS_WINDOW=window, SOFTCAP=50.0, **prefill)
build(prefill_attention._paged_prefill_kernel, "fp32", 4, GROUP=1, GROUP_PAD=1, HEAD_DIM=64,
      PAGE_SIZE=16, BLOCK_M=16, BLOCK_Q=16, BLOCK_N=32, HAS_WINDOW=False, DOT_PRECISION="ieee",
      SOFTCAP=0.0)
build(cache_ops._write_kv_cache_kernel, "bf16", PAGE_SIZE=16, HEADS_PAD=8, DIM_PAD=128)
for has_residual in (False, True):
    build(rms_norm._rms_norm_kernel, "bf16", 8, HAS_RESIDUAL=has_residual, BLOCK=4096)
build(rotary._rotary_kernel, "bf16", HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8)
build(activation._silu_and_mul_kernel, "bf16", BLOCK=1024)
moe_ids = {"sorted_ids_ptr": "*i64", "block_expert_ptr": "*i64"}
for dtype, precision in (("bf16", None), ("fp32", "ieee")):
    build(fused_moe._gate_up_kernel, dtype, pointers=moe_ids, BLOCK_M=16, BLOCK_N=64,
          BLOCK_K=64, PRECISION=precision)
    build(fused_moe._down_kernel, dtype,
          pointers={**moe_ids, "out_ptr": "*fp32", "weights_ptr": "*fp32"},
          BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, PRECISION=precision)
lora_ids = {"row_ids_ptr": "*i64", "block_slot_ptr": "*i64", "scales_ptr": "*fp32"}
for dtype, precision in (("bf16", None), ("fp32", "ieee")):
    for block_m, block_k in ((1, 128), (16, 64)):  # BGMV (decode rows), SGMV (sorted blocks)
        build(lora._shrink_kernel, dtype, pointers=lora_ids, BLOCK_M=block_m, BLOCK_R=16,
              BLOCK_K=block_k, PRECISION=precision)
        build(lora._expand_kernel, dtype, pointers=lora_ids, BLOCK_M=block_m, BLOCK_N=64,
              BLOCK_R=16, PRECISION=precision)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    # 4 of them with int64 lengths (3 attention kernels).
    assert result.stdout.count("compiled") == 23 + 6 + 12 + 8 + 4, result.stdout
    pipelines = [line.split() for line in result.stdout.splitlines() if "pipeline" in line]
    assert len(pipelines) == 6 + 12 + 6  # decode and prefill configs, decode variants
    for kernel, _, stages, buffers, in_flight in pipelines:
        if int(stages) >= 3:
            # Multi-buffered: tile i + 1 (and i + 2 at 4 stages) loads while tile i computes,
            # so the wait at the top of the loop leaves those copies in flight. (Hopper's
            # asynchronous wgmma, on 128-row prefill tiles, holds one buffer more.)
            assert int(buffers) >= int(stages) - 1, (kernel, stages, buffers)
            assert int(in_flight) > 0, (kernel, stages, in_flight)
