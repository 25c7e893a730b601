"""Linear layers with the fast copies of their weights that CPU inference wants.

A model declares its projections as `Linear` and its LM head as a `LogitsHead`; after
loading, `prepack_linears` gives the projections their oneDNN-packed copies (bf16 on CPU)
and `attach_quantized` the GGUF file's own blocks (fp32 on CPU,
`gpu_worker.ops.gguf_linear`); the head has its own `prepack` and `attach`. With
`--cpu-precision fast` an fp32 CPU model also gets packed bf16 copies (`fast_weight`,
`gpu_worker.ops.cpu_precision`), which prefill and batched decode multiply in bf16 with
fp32 accumulation. The model code never sees which path runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.ops.gguf_linear import QuantizedWeight

StackedParams = Mapping[str, tuple[str, int, int]]
"""Checkpoint projection name -> (the model's fused projection, its rows there), e.g.
`{"q_proj": ("qkv_proj", 0, q_size), ...}`: how a model fuses HF's separate matrices."""


class Linear(nn.Linear):
    """nn.Linear that runs on a weight prepacked for oneDNN where `prepack` made one.

    On CPU, a bf16 `F.linear` reorders the whole weight into oneDNN's blocked layout on
    every call, which costs about as much as the matmul at decode sizes. Packing once at
    load gives the same results bit for bit and is faster at every batch size on an AMX
    Xeon, for a second copy of the weights. fp32 stays on MKL's sgemm: packing there
    was slower for single tokens and large prefills. fp32 decode-sized batches run on the
    GGUF blocks in `quantized` where the loader kept them.
    """

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    fast_weight: torch.Tensor | None = None
    """--cpu-precision fast: the weight in bf16, packed (None: exact fp32 only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_weight is not None and takes_fast_path(self.quantized, x):
            return fast_linear(x, self.fast_weight, self.bias)
        if self.quantized is not None and self.quantized.accepts(x):
            return self.quantized.linear(x, self.bias)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class LogitsHead:
    """The LM head's matmul: hidden states -> fp32 logits, on the same fast copies as
    `Linear`. The weight itself stays the model's (its own head, or the embedding matrix of
    a tied model, read directly so that no second copy can drift); this holds only the
    packed and quantized copies of it."""

    def __init__(self) -> None:
        self.packed_weight: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.fast_weight: torch.Tensor | None = None
        """As `Linear.fast_weight`."""

    def prepack(self, weight: torch.Tensor) -> None:
        """As `prepack_linears` does for the projections."""
        self.packed_weight = prepack(weight.detach())
        self.quantized = None

    def attach(self, blocks: QuantizedWeight | None, weight: torch.Tensor) -> None:
        """Use the GGUF blocks of `weight` when they are its shape."""
        if blocks is not None and (blocks.n, blocks.k) == weight.shape:
            self.quantized = blocks

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fast_weight is not None and takes_fast_path(self.quantized, hidden):
            return fast_linear(hidden, self.fast_weight)
        if self.quantized is not None and self.quantized.accepts(hidden):
            return self.quantized.linear(hidden)
        if self.packed_weight is not None:
            logits = torch.ops.mkldnn._linear_pointwise(
                hidden, self.packed_weight, None, "none", [], ""
            )
            return logits.float()
        return F.linear(hidden, weight).float()


FAST_MIN_ROWS = 9
"""With a fast copy, a layer that also has GGUF blocks multiplies up to 8 rows on the
blocks: a step of a few rows is bound by the bytes it reads, and the blocks are the
fewest; from 9 rows the step is bound by arithmetic, where bf16 dot products do twice
fp32's per instruction (bench/cpu_precision.py)."""


def takes_fast_path(quantized: QuantizedWeight | None, x: torch.Tensor) -> bool:
    """Whether a layer with a fast copy multiplies `x` on it rather than on its blocks."""
    return quantized is None or x.shape[0] >= FAST_MIN_ROWS or not quantized.accepts(x)


def fast_linear(
    x: torch.Tensor, fast_weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 x @ W^T (+ bias) with x rounded to bf16 and W the packed bf16 copy: oneDNN
    accumulates in fp32 and rounds the output to bf16; the bias is added in fp32."""
    y = torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), fast_weight, None, "none", [], ""
    ).float()
    return y if bias is None else y.add_(bias)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a bf16 [out, in] weight on CPU; None for other devices and
    dtypes, and where this build of torch or this CPU cannot run it (callers then keep
    plain `F.linear`)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    try:
        if not (
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            return None
        # The batch size only hints the blocking; measured faster from 1 to 2048 rows.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        probe = weight.new_zeros((1, weight.shape[1]))
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError):  # an op missing or refused on this build
        return None


def prepack_linears(model: nn.Module) -> None:
    """Give every `Linear` of `model` its packed copy where that pays (`prepack`). Call it
    again after changing any weight; that also drops the quantized copies, which cannot
    follow the change."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed_weight = prepack(module.weight.detach())
            module.quantized = None


def attach_quantized(
    model: nn.Module, weights: Mapping[str, QuantizedWeight], stacked: StackedParams
) -> None:
    """Give each `Linear` of `model` the GGUF blocks of its weight (`weights` by checkpoint
    name, rows as in the dense weights), a fused one its parts stacked in row order. A
    layer with any part missing, of another type or of another shape stays dense."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        prefix, _, fused = name.rpartition(".")
        parts = sorted((start, part) for part, (f, start, _) in stacked.items() if f == fused)
        names = [f"{prefix}.{part}.weight" for _, part in parts or [(0, fused)]]
        blocks = [weights[n] for n in names if n in weights]
        if len(blocks) != len(names):
            continue
        quantized = QuantizedWeight.cat(blocks)
        if quantized is not None and (quantized.n, quantized.k) == module.weight.shape:
            module.quantized = quantized
