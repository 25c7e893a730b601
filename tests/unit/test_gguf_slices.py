"""A lazy GGUF tensor (`GGUFTensorSource`, as `iter_gguf_slices` yields them): every part
a shard hook asks for equals the loader's whole-tensor dequantization (`iter_gguf_weights`)
indexed alike, bit for bit, and only the blocks covering the part are dequantized."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from gpu_worker.gguf_tensors import GGUFTensorSource
from gpu_worker.loader import iter_gguf_slices, iter_gguf_weights
from gpu_worker.models.config import ModelConfig

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

# GGUF name -> (type, torch shape). Q4_K and Q6_K hold random blocks: the gguf package
# cannot quantize them, and any blocks show whether parts match the whole.
TENSORS: dict[str, tuple[Q, tuple[int, ...]]] = {
    "token_embd.weight": (Q.Q8_0, (10, 64)),
    "blk.0.attn_q.weight": (Q.Q4_0, (HEADS * HEAD_DIM, 96)),
    "blk.0.attn_q.bias": (Q.F32, (HEADS * HEAD_DIM,)),
    "blk.0.attn_k.weight": (Q.Q4_K, (KV_HEADS * HEAD_DIM, 512)),
    "blk.0.attn_v.weight": (Q.F16, (KV_HEADS * HEAD_DIM, 96)),
    "blk.0.attn_output.weight": (Q.BF16, (96, 64)),
    "blk.0.ffn_gate.weight": (Q.Q4_1, (40, 96)),
    "blk.0.ffn_down.weight": (Q.Q6_K, (24, 512)),
    "blk.0.ffn_up.weight": (Q.F32, (40, 64)),
    "blk.0.attn_norm.weight": (Q.F32, (64,)),
    "blk.0.ffn_gate_exps.weight": (Q.Q8_0, (3, 8, 64)),
    "blk.0.ffn_down_exps.weight": (Q.Q4_0, (3, 64, 32)),
}


def _config(arch: str) -> ModelConfig:
    """What the two iterators read of a config: the architecture and the head counts."""
    return ModelConfig(
        architecture=arch,
        vocab_size=10,
        hidden_size=64,
        intermediate_size=40,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


# Where a K-quant block keeps its fp16 scales (Q4_K: d, dmin first; Q6_K: d last): set to
# finite values, so that random bytes dequantize to numbers.
_FP16_SCALES = {Q.Q4_K: slice(0, 4), Q.Q6_K: slice(208, 210)}


def _stored(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if qtype in _FP16_SCALES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        num_blocks = int(np.prod(shape)) // block_size
        blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
        where = _FP16_SCALES[qtype]
        num_scales = (where.stop - where.start) // 2
        scales = rng.uniform(-0.1, 0.1, (num_blocks, num_scales)).astype(np.float16)
        blocks[:, where] = scales.view(np.uint8)
        return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return values
    return gguf.quants.quantize(values, qtype)


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> gguf.GGUFReader:
    path = tmp_path_factory.mktemp("gguf") / "tensors.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, (qtype, shape) in TENSORS.items():
        stored = _stored(qtype, shape, rng)
        writer.add_tensor(name, stored, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def _indexes(shape: tuple[int, ...]) -> Iterator[Any]:
    """The whole, then a part of each dimension alone (block-aligned, unaligned, inside one
    block for the last), then a part of every dimension at once."""
    yield slice(None)
    last = len(shape) - 1
    for dim, size in enumerate(shape):
        if dim == last:
            parts = [slice(32, size), slice(3, size - 5), slice(5, 9), slice(size - 1, size)]
        else:
            parts = [slice(1, size - 1), slice(size // 2, None)]
        for part in parts:
            yield (slice(None),) * dim + (part,)
    yield tuple(slice(1, size - 3) for size in shape)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_every_part_equals_the_whole_tensor_indexed(reader: gguf.GGUFReader, arch: str) -> None:
    """llama: Q/K rows (and the Q bias) read through llama.cpp's rotary order; gemma2: the
    norm's stored 1 taken off, Q/K rows as stored."""
    config = _config(arch)
    wholes = dict(iter_gguf_weights(reader, config, num_threads=1))
    sources = dict(iter_gguf_slices(reader, config))
    assert sources.keys() == wholes.keys()
    assert len(sources) == len(TENSORS)
    for name, source in sources.items():
        whole = wholes[name]
        assert isinstance(source, GGUFTensorSource)
        assert source.get_shape() == list(whole.shape)
        for index in _indexes(tuple(whole.shape)):
            part = source[index]
            expected = whole[index]
            assert part.dtype == torch.float32, (name, index)
            assert part.is_contiguous(), (name, index)
            assert torch.equal(part, expected), (name, index)


def test_q_rows_follow_llama_cpp_order(reader: gguf.GGUFReader) -> None:
    """Not a mere check that both paths agree: a head's first rotary half is the file's
    even rows of that head (llama.cpp interleaves the halves)."""
    sources = dict(iter_gguf_slices(reader, _config("llama")))
    q = sources["model.layers.0.self_attn.q_proj.weight"]
    data = reader.tensors[[t.name for t in reader.tensors].index("blk.0.attn_q.weight")].data
    file_rows = gguf.quants.dequantize(np.asarray(data), Q.Q4_0)
    head = 1
    first_half = q[head * HEAD_DIM : head * HEAD_DIM + HEAD_DIM // 2]
    expected = file_rows[head * HEAD_DIM : (head + 1) * HEAD_DIM : 2]
    assert torch.equal(first_half, torch.from_numpy(expected))


def _dequantized_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every byte array handed to `gguf.quants.dequantize` from now on."""
    sizes: list[int] = []
    dequantize = gguf.quants.dequantize

    def counting(data: np.ndarray, qtype: Q) -> np.ndarray:
        sizes.append(data.nbytes)
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    return sizes


def test_only_the_blocks_covering_a_part_are_dequantized(
    reader: gguf.GGUFReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = dict(iter_gguf_slices(reader, _config("llama")))
    gate = sources["model.layers.0.mlp.gate_proj.weight"]  # Q4_1 (40, 96): 3 blocks a row
    row_bytes = 3 * gguf.GGML_QUANT_SIZES[Q.Q4_1][1]
    sizes = _dequantized_bytes(monkeypatch)
    gate[10:20]
    gate[:, 32:64]  # one aligned block of each row
    gate[:, 40:70]  # unaligned: the two blocks it touches
    gate[4:6, 95:96]  # the last block of two rows
    assert sizes == [10 * row_bytes, 40 * row_bytes // 3, 40 * row_bytes * 2 // 3, 2 * 20]
    experts = sources["model.layers.0.mlp.experts.gate_proj.weight"]  # Q8_0 (3, 8, 64)
    sizes.clear()
    experts[:, 2:4]
    experts[1:2, :, 32:64]
    assert sizes == [3 * 2 * 2 * 34, 8 * 34]


def test_indexes_it_cannot_read_lazily_are_refused(reader: gguf.GGUFReader) -> None:
    source = dict(iter_gguf_slices(reader, _config("llama")))["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="step 1"):
        source[::2]
    with pytest.raises(TypeError, match="basic slices"):
        source[0]
    with pytest.raises(IndexError, match="3 indices"):
        source[:, :, :]
    assert source[5:5].shape == (0, 64)


def test_a_row_order_must_cover_the_rows(tmp_path: Path, reader: gguf.GGUFReader) -> None:
    tensor = reader.tensors[0]
    with pytest.raises(ValueError, match="row indices"):
        GGUFTensorSource(tensor, row_order=np.arange(3))
