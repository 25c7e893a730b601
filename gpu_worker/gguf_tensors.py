"""A GGUF tensor read lazily: indexing it dequantizes only the part it names.

A tensor-parallel rank keeps a few rows or columns of each weight; reading its GGUF
tensors this way it never dequantizes (nor pages in) the rest of the file. A quantized
GGUF row (torch's last dimension) is a run of independent blocks of `block_size` values
in `type_size` bytes, and rows are independent of each other, so a row range is a range
of byte rows of the memory-mapped file and a column range is the run of blocks covering
it (cut to the exact columns once dequantized). Dequantizing a block is elementwise, so
the part is bit-for-bit what dequantizing the whole tensor and indexing it gives.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor

# Types the reader hands back as numbers (one value per item), not as bytes of blocks.
_TYPED = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


class GGUFTensorSource:
    """One GGUF tensor in torch's dimension order (outermost first), dequantized to fp32 on
    indexing. `row_order[i]` is the file row holding row `i` (llama.cpp stores Q/K rows
    in its own rotary order); `stored_offset` is what the converter added to every value
    (Gemma's norms hold 1 + weight) and is taken off again. Indexes are basic slices of
    step 1 over up to all dimensions (`src[:]`, `src[a:b]`, `src[:, a:b]`, ...), as the
    tensor-parallel shard hook and safetensors' lazy slices use them."""

    def __init__(
        self,
        tensor: ReaderTensor,
        row_order: np.ndarray | None = None,
        stored_offset: float = 0.0,
    ) -> None:
        self.tensor = tensor
        self.qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        # gguf lists dimensions innermost first.
        self.shape = tuple(int(d) for d in reversed(tensor.shape))
        if row_order is not None and len(row_order) != self.shape[0]:
            raise ValueError(f"{tensor.name}: {len(row_order)} row indices for {self.shape}")
        self.row_order = row_order
        self.stored_offset = stored_offset

    def get_shape(self) -> list[int]:
        """The shape, as a safetensors slice answers it."""
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        ranges = _ranges(index, self.shape)
        if any(r.start == r.stop for r in ranges):
            return torch.empty([r.stop - r.start for r in ranges])
        if self.row_order is not None and len(self.shape) == 1:
            # A permuted vector (a Q/K bias): small, and its order crosses the blocks.
            values = self._read((), slice(0, self.shape[0]))[self.row_order][ranges[0]]
        else:
            outer: tuple[slice | np.ndarray, ...] = tuple(ranges[:-1])
            if self.row_order is not None:
                outer = (self.row_order[ranges[0]], *outer[1:])
            values = self._read(outer, ranges[-1])
        if self.stored_offset:
            values = values - np.float32(self.stored_offset)  # a new array
        if not values.flags.writeable:  # F32 parts come back as views of the read-only mmap
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def _read(self, outer: tuple[slice | np.ndarray, ...], columns: slice) -> np.ndarray:
        """Dequantize the blocks of rows `outer` (an index over all dimensions but the
        last; one index array at most) that cover `columns`, and cut those columns."""
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        if self.qtype in _TYPED:  # one item per value
            block_size, type_size = 1, 1
        first, end = columns.start // block_size, -(-columns.stop // block_size)
        raw = self.tensor.data[(*outer, slice(first * type_size, end * type_size))]
        values = gguf.quants.dequantize(raw, self.qtype)
        cut = columns.start - first * block_size
        if cut or values.shape[-1] != columns.stop - columns.start:
            values = values[..., cut : cut + columns.stop - columns.start]
        return values


def _ranges(index: Any, shape: tuple[int, ...]) -> list[slice]:
    """`index` as one `slice(start, stop)` per dimension, within bounds, dimensions it
    leaves out whole."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > len(shape):
        raise IndexError(f"{len(parts)} indices for a tensor of shape {shape}")
    ranges = []
    for dim, size in enumerate(shape):
        part = parts[dim] if dim < len(parts) else slice(None)
        if not isinstance(part, slice):
            raise TypeError(f"a lazy GGUF tensor takes basic slices, not {part!r}")
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a lazy GGUF tensor takes slices of step 1, not {part!r}")
        ranges.append(slice(start, max(start, stop)))
    return ranges
