"""The GGUF kernel's GEMM against a float64 reference, within fp32 rounding."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch

from gpu_worker.ops.gguf_linear import QuantizedWeight


def check_gemm_against_float64(
    ext: ModuleType,
    quantized: QuantizedWeight,
    dense: torch.Tensor,
    row_counts: Iterable[int],
    gen: torch.Generator,
    vector: bool,
) -> None:
    """`ext.gemm` over `quantized` (whose weights dequantize to `dense` [n, k], float64)
    for x of each row count, with and without a bias, equals `x @ dense.T (+ bias)` within
    fp32 rounding of sums accumulated in order: at most k+1 ulps of the sum of |products|
    (and of |bias|). A wrong weight or row is off by far more."""
    n, k = dense.shape
    bias = torch.randn(n, generator=gen)
    for m in row_counts:
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            y = ext.gemm(x, quantized.data, quantized.qtype, b, vector)
            expected = x.double() @ dense.T + (0 if b is None else b.double())
            scale = x.double().abs() @ dense.abs().T + (0 if b is None else b.abs().double())
            err = (y.double() - expected).abs()
            assert y.dtype == torch.float32
            assert y.shape == (m, n)
            bound = (k + 1) * 2.0**-24 * scale + 1e-30
            assert bool((err <= bound).all()), (n, k, m, float(err.max()))
