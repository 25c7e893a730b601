"""A quantized GGUF file at TP=2 (2 gloo ranks on CPU): each rank dequantizes only the
blocks of its shard, and rank 0's logits equal TP=1's on the same file.

The file is what llama.cpp's converter writes for a tiny Llama: Q/K rows permuted into its
rotary order, Q8_0 embedding and head, Q4_0 attention and gate/up, Q4_1 down, F32 norms.
Its 9 heads over 3 KV heads split unevenly (rank 1 takes 2 of 3 KV groups), its 255-row
vocabulary pads rank 1's shard, and its 96-wide MLP splits down_proj's 32-wide blocks in
the middle (columns 48 on), so a rank reads Q/K rows through the order and cuts blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

import gpu_worker.loader
from gpu_worker.distributed.group import TPGroup
from gpu_worker.loader import gguf_to_hf_name, load_model
from gpu_worker.models.weights import TensorSource
from shared.model_source import resolve_model
from tests.helpers.gguf_files import gguf_file
from tests.helpers.tiny_models import tiny_hf_model
from tests.integration.test_tp_collectives import WORLD, run_ranks
from tests.integration.test_tp_model import _prefill_and_decode

Q = gguf.GGMLQuantizationType
HF_SIZES: dict[str, Any] = dict(
    hidden_size=288,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=96,
    vocab_size=255,
)
PROMPT = [3, 17, 42, 99, 7, 254, 128, 5, 61]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _qtype(name: str) -> Q:
    if name.endswith("norm.weight"):
        return Q.F32
    if "embed_tokens" in name or name == "lm_head.weight":
        return Q.Q8_0
    return Q.Q4_1 if "down_proj" in name else Q.Q4_0


def _write_gguf(hf: transformers.PreTrainedModel, path: Path) -> None:
    cfg = hf.config
    with gguf_file(cfg, path, "llama") as writer:
        writer.add_vocab_size(cfg.vocab_size)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
        for name, tensor in hf.state_dict().items():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            assert gguf_to_hf_name(gguf_name) == name
            values = tensor.numpy()
            if "q_proj" in name:
                values = _llama_cpp_permute(values, cfg.num_attention_heads)
            elif "k_proj" in name:
                values = _llama_cpp_permute(values, cfg.num_key_value_heads)
            qtype = _qtype(name)
            stored = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
            writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype == Q.F32 else qtype)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp_gguf") / "tiny-llama.Q4_0.gguf"
    _write_gguf(tiny_hf_model("llama", tie_word_embeddings=False, **HF_SIZES), path)
    return path


def _rank_check(path: Path, out: Path, group: TPGroup) -> None:
    result = _prefill_and_decode(resolve_model(str(path)), group, PROMPT)
    torch.save(result, out / f"rank{group.rank}.pt")


@pytest.mark.slow
def test_rank0_logits_match_tp1(gguf_path: Path, tmp_path: Path) -> None:
    errors = tmp_path / "errors"
    errors.mkdir()
    run_ranks(functools.partial(_rank_check, gguf_path, tmp_path), errors, timeout_s=60, wall_s=120)
    tp1 = _prefill_and_decode(resolve_model(str(gguf_path)), None, PROMPT)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for full, sharded in zip(tp1["logits"], ranks[0]["logits"], strict=True):
        assert sharded.shape == full.shape
        torch.testing.assert_close(sharded, full, atol=1e-4, rtol=0)
    shares = [rank["sharded"] / tp1["sharded"] for rank in ranks]
    assert all(0.4 <= share <= 0.6 for share in shares), shares
    assert 1.0 <= sum(shares) <= 1.01, shares


class _Reading:
    """A lazy tensor that names itself to the dequantization counter while it is read."""

    def __init__(self, source: TensorSource, name: str, reading: list[str]) -> None:
        self.source, self.name, self.reading = source, name, reading

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.reading[:] = [self.name]
        return self.source[index]


def test_a_rank_dequantizes_only_its_blocks(
    gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading needs no collective, so one process plays rank 1 of 2. Of each tensor but
    the replicated norms it dequantizes at most 2/3 of the bytes (it keeps 2 of 3 KV
    groups: 6 of 9 query heads), never the whole."""
    reader = gguf.GGUFReader(gguf_path)
    whole = {name: int(t.n_bytes) for t in reader.tensors if (name := gguf_to_hf_name(t.name))}
    read: dict[str, int] = {}
    reading: list[str] = []
    dequantize, slices = gguf.quants.dequantize, gpu_worker.loader.iter_gguf_slices

    def counting(data: np.ndarray, qtype: Q) -> np.ndarray:
        read[reading[0]] = read.get(reading[0], 0) + data.nbytes
        return dequantize(data, qtype)

    def named(*args: Any) -> Iterator[tuple[str, TensorSource]]:
        for name, source in slices(*args):
            yield name, _Reading(source, name, reading)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    monkeypatch.setattr(gpu_worker.loader, "iter_gguf_slices", named)
    group = TPGroup(rank=1, world_size=2, device=torch.device("cpu"), backend="gloo")
    load_model(resolve_model(str(gguf_path)), torch.device("cpu"), tp_group=group)
    assert read.keys() == whole.keys()
    for name, size in read.items():
        if name.endswith("norm.weight"):
            assert size == whole[name], name
        else:
            assert 3 * size <= 2 * whole[name], (name, size, whole[name])
