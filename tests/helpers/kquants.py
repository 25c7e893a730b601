"""K-quant GGUF blocks written from float weights, and tiny Llama GGUF files that use them.

gguf-py dequantizes Q4_K, Q5_K and Q6_K but has no quantizers for them, so tests that need
such files make their own here: a plain min/max (Q4_K, Q5_K) or absmax (Q6_K) quantizer
per sub-block, the sub-block scales quantized against the superblock's fp16 ones, packed
in ggml's byte layout (ggml-common.h `block_q4_K`, `block_q5_K`, `block_q6_K`). It is not
llama.cpp's error-minimizing search, only correct: gguf's `dequantize` of its bytes is
close to the input (tests/unit/test_gguf_kquants.py bounds how close).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import gguf
import numpy as np
import transformers

from gpu_worker.loader import gguf_to_hf_name
from tests.helpers.gguf_files import gguf_file

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPER = 256  # weights per superblock


def _fp16(values: np.ndarray) -> np.ndarray:
    """fp16 values back in fp32 (what dequantizing will multiply by)."""
    return values.astype(np.float16).astype(np.float32)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0."""
    safe = np.where(denominator == 0, 1, denominator)
    return np.where(denominator == 0, 0, numerator / safe).astype(np.float32)


def _pack_scales_6bit(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """[b, 8] 6-bit scales and mins -> ggml's 12 bytes (`get_scale_min_k4` reverses it):
    bytes 0-3 and 4-7 hold sub-blocks 0-3's scale and min, their top 2 bits sub-blocks
    4-7's high bits; bytes 8-11 the low nibbles of sub-blocks 4-7's scale and min."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _quantize_min_max(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """[b, 256] -> d, dmin [b] (fp16 bytes), scales and mins [b, 8] (6-bit) and quants
    [b, 8, 32] in 0..levels, with w ~= d * sc * q - dmin * m."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # mins are subtracted: offsets <= 0 only
    step = (sub.max(axis=-1) - low) / levels
    d = _fp16(step.max(axis=-1) / 63)
    dmin = _fp16(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(_divide(step, d[:, None])), 0, 63)
    m = np.clip(np.rint(_divide(-low, dmin[:, None])), 0, 63)
    d_sub = (d[:, None] * sc)[..., None]
    dm_sub = (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_divide(sub + dm_sub, d_sub)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _low_nibble_bytes(q: np.ndarray) -> np.ndarray:
    """[b, 8, 32] quants -> 128 bytes: each 32 hold two sub-blocks, the first in the low
    nibbles."""
    pairs = q.reshape(-1, 4, 2, 32) & 0x0F
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[b, 256] fp32 -> [b, 144] Q4_K: d, dmin (fp16), 12 bytes of scales, 128 of quants."""
    d, dmin, sc, m, q = _quantize_min_max(blocks, 15)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
            _pack_scales_6bit(sc, m),
            _low_nibble_bytes(q),
        ],
        axis=-1,
    )


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[b, 256] fp32 -> [b, 176] Q5_K: as Q4_K, with 32 bytes of 5th bits before the
    quants (bit u of byte i: element i of sub-block u)."""
    d, dmin, sc, m, q = _quantize_min_max(blocks, 31)
    high = (q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]  # [b, 8, 32]
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
            _pack_scales_6bit(sc, m),
            qh,
            _low_nibble_bytes(q),
        ],
        axis=-1,
    )


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[b, 256] fp32 -> [b, 210] Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16
    int8 scales (one per 16 weights), d (fp16); w ~= d * sc * (q - 32)."""
    sub = blocks.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    step = amax / 31  # q - 32 in -31..31 covers +-amax
    d = _fp16(step.max(axis=-1) / 127)
    sc = np.clip(np.rint(_divide(step, d[:, None])), -128, 127)
    q = np.clip(np.rint(_divide(sub, (d[:, None] * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [b, half, row, column]
    # A half's 64 low-nibble bytes hold rows 0-1 (low nibbles) and 2-3 (high); its 32
    # high bytes hold rows 0-3 at bits 0, 2, 4, 6.
    low = q & 0x0F
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((q >> 4) << shifts, axis=2).reshape(-1, 64)
    return np.concatenate(
        [
            ql,
            qh,
            sc.astype(np.int8).view(np.uint8).reshape(-1, 16),
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
        ],
        axis=-1,
    )


_QUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q4_K: quantize_q4_k,
    Q.Q5_K: quantize_q5_k,
    Q.Q6_K: quantize_q6_k,
}


def quantize(values: np.ndarray, qtype: Q) -> np.ndarray:
    """[..., k] fp32 -> the GGUF bytes [..., k / block * type_size] of `qtype`: ours for the
    K-quants (k a multiple of 256), gguf's own for the types it can quantize."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype not in _QUANTIZERS:
        return gguf.quants.quantize(values, qtype)
    *outer, k = values.shape
    if k % SUPER:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {SUPER} values, not {k}")
    blocks = _QUANTIZERS[qtype](values.reshape(-1, SUPER))
    return blocks.reshape(*outer, k // SUPER * gguf.GGML_QUANT_SIZES[qtype][1])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (Q/K rows to its rotary order)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(
    hf: transformers.PreTrainedModel, path: Path, qtype_of: Callable[[str], Q]
) -> None:
    """`hf` (a Llama) as llama.cpp's converter would write it, each matrix in
    `qtype_of(hf_name)` (norms stay F32)."""
    tensors = ((name, tensor.numpy()) for name, tensor in hf.state_dict().items())
    write_llama_tensors(hf.config, tensors, path, qtype_of)


def write_llama_tensors(
    cfg: transformers.PretrainedConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    path: Path,
    qtype_of: Callable[[str], Q],
) -> None:
    """HF-named Llama tensors written as `write_llama_gguf` does; `tensors` is read one at
    a time, so a generator keeps one fp32 matrix in memory at once."""
    with gguf_file(cfg, path, "llama") as writer:
        writer.add_vocab_size(cfg.vocab_size)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
        for name, values in tensors:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            assert gguf_to_hf_name(gguf_name) == name
            if "q_proj" in name:
                values = llama_cpp_permute(values, cfg.num_attention_heads)
            elif "k_proj" in name:
                values = llama_cpp_permute(values, cfg.num_key_value_heads)
            qtype = Q.F32 if values.ndim == 1 else qtype_of(name)
            stored = quantize(values, qtype)
            writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype == Q.F32 else qtype)


def random_llama_tensors(
    cfg: transformers.LlamaConfig, seed: int = 0
) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named weights of a random Llama with activations that stay O(1): embeddings
    unit normal, matrices N(0, 1 / fan-in), norms near one. Drawn one tensor at a time
    (no transformers model: a benchmark-sized one would hold every weight twice)."""
    rng = np.random.default_rng(seed)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = hidden // cfg.num_attention_heads
    kv = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim

    def matrix(n: int, k: int) -> np.ndarray:
        return rng.standard_normal((n, k), dtype=np.float32) * np.float32(k**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)).astype(np.float32)

    yield (
        "model.embed_tokens.weight",
        rng.standard_normal((cfg.vocab_size, hidden), dtype=np.float32),
    )
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        yield f"{layer}.input_layernorm.weight", norm()
        for proj, rows in (("q", hidden), ("k", kv), ("v", kv), ("o", hidden)):
            yield f"{layer}.self_attn.{proj}_proj.weight", matrix(rows, hidden)
        yield f"{layer}.post_attention_layernorm.weight", norm()
        yield f"{layer}.mlp.gate_proj.weight", matrix(inter, hidden)
        yield f"{layer}.mlp.up_proj.weight", matrix(inter, hidden)
        yield f"{layer}.mlp.down_proj.weight", matrix(hidden, inter)
    yield "model.norm.weight", norm()
    yield "lm_head.weight", matrix(cfg.vocab_size, hidden)


def one_type(qtype: Q) -> Callable[[str], Q]:
    """`qtype` for every matrix."""
    return lambda name: qtype


def q4_k_m_type(name: str) -> Q:
    """A Q4_K_M-like mix: the value and down projections (and the head) in Q6_K, the rest
    Q4_K, so that fused qkv layers mix types as llama.cpp's files do."""
    if "v_proj" in name or "down_proj" in name or name == "lm_head.weight":
        return Q.Q6_K
    return Q.Q4_K
