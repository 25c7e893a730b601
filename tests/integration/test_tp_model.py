"""A loaded model at TP=2 (2 gloo ranks on CPU) computes the TP=1 model's logits, each
rank reading and holding only its shard of the weights.

Tiny random HF checkpoints: Llama with attention biases (o_proj's bias is rank 0's alone)
and an untied head, Qwen3 (q/k norms) tied, Phi-3 (q/k/v and gate/up fused in the
checkpoint), Gemma 2 (GeGLU, soft-capping, scaled embeddings) and a SmolLM2-shaped Llama
whose 9 heads over 3 KV heads split unevenly over 2 ranks, with a vocabulary of 255 rows
(the last rank's embedding and head shards padded); and the mixtures of experts: Mixtral
(4 experts, top-2, every layer sparse) and Qwen3-MoE with a dense first layer and experts
of 33 inner rows, split 16 and 17 (the router whole on each rank). One spawn of the two
ranks loads them with `load_model(..., tp_group=...)` and runs a prefill and a decode step
through the torch attention backend, each rank's paged KV cache sized for its local KV
heads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import gpu_worker.loader
from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.sharding import local_heads
from gpu_worker.loader import load_model
from gpu_worker.models.weights import TensorSource
from shared.model_source import ModelSource, resolve_model
from tests.helpers.tiny_models import PagedRunner, save_tiny_model
from tests.integration.test_tp_collectives import WORLD, run_ranks

MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama", tie_word_embeddings=False, attention_bias=True),
    "qwen3": dict(family="qwen3", tie_word_embeddings=True),
    # Phi-3's checkpoint fuses q/k/v and gate/up itself: the rank slices each part.
    "phi3": dict(family="phi3", tie_word_embeddings=False),
    "gemma2": dict(family="gemma2", tie_word_embeddings=True),
    "smollm2_shape": dict(
        family="llama",
        tie_word_embeddings=True,
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=255,
    ),
    "mixtral": dict(family="mixtral", tie_word_embeddings=False),
    "qwen3_moe": dict(
        family="qwen3_moe", tie_word_embeddings=True, mlp_only_layers=[0], moe_intermediate_size=33
    ),
}
PROMPT = [3, 17, 42, 99, 7, 254, 128, 5, 61]
DECODE_TOKEN = 11


def _replicated(name: str) -> bool:
    """Parameters every rank keeps whole (norms, MoE routers), or rank 0 alone (row-parallel
    biases): left out of the bytes that shard."""
    return name.endswith(("norm.weight", "o_proj.bias", "mlp.gate.weight"))


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes that shard, of which the experts', and bytes replicated, over the model's
    parameters."""
    sizes = dict.fromkeys(("sharded", "experts", "replicated"), 0)
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        sizes["replicated" if _replicated(name) else "sharded"] += size
        if ".experts." in name:
            sizes["experts"] += size
    return sizes


@torch.no_grad()
def _prefill_and_decode(
    source: ModelSource, group: TPGroup | None, prompt: list[int] = PROMPT
) -> dict[str, Any]:
    # A rank's shard runs on dense weights: so does the reference, not on GGUF blocks.
    model, config = load_model(
        source, torch.device("cpu"), torch.float32, gguf_kernels=False, tp_group=group
    )
    if group is not None:
        heads = local_heads(config.num_heads, config.num_kv_heads, group.world_size, group.rank)
        config = dataclasses.replace(config, num_kv_heads=heads.num_kv_heads)
    runner = PagedRunner(model, config, block_size=4)
    prefill = runner.step({0: prompt})[0]
    decode = runner.step({0: [DECODE_TOKEN]})[0]
    return {"logits": (prefill, decode), **_param_bytes(model)}


def _rank_check(dirs: dict[str, Path], out: Path, group: TPGroup) -> None:
    for name, model_dir in dirs.items():
        result = _prefill_and_decode(resolve_model(str(model_dir)), group)
        torch.save(result, out / f"{name}.rank{group.rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each model's TP=1 result and both ranks' TP=2 results."""
    root = tmp_path_factory.mktemp("tp_model")
    dirs: dict[str, Path] = {}
    for name, spec in MODELS.items():
        spec = dict(spec)
        family = spec.pop("family")
        dirs[name], _ = save_tiny_model(root / name, family, **spec)
    errors = root / "errors"
    errors.mkdir()
    check = functools.partial(_rank_check, dirs, root)
    run_ranks(check, errors, timeout_s=60.0, wall_s=180.0)
    return {
        name: {
            "tp1": _prefill_and_decode(resolve_model(str(model_dir)), None),
            "ranks": [torch.load(root / f"{name}.rank{r}.pt") for r in range(WORLD)],
        }
        for name, model_dir in dirs.items()
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_rank0_logits_match_tp1(runs: dict[str, Any], name: str) -> None:
    tp1, ranks = runs[name]["tp1"], runs[name]["ranks"]
    for full, sharded in zip(tp1["logits"], ranks[0]["logits"], strict=True):
        assert sharded.shape == full.shape
        torch.testing.assert_close(sharded, full, atol=1e-4, rtol=0)
    # The other rank computes its vocabulary's logits but only rank 0 gathers them.
    assert all(logits.shape[-1] == 0 for logits in ranks[1]["logits"])


# How far from half a rank's share of the weights may be, where heads or experts split
# unevenly: SmolLM2's shape gives rank 1 two of 3 KV groups of attention; Qwen3-MoE's 33
# expert rows give rank 1 17 of them, the experts being 44% of that model (rank 1: 50.7%).
SHARE_TOLERANCE = {"smollm2_shape": 0.1, "qwen3_moe": 0.01}


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_about_half_the_weights(runs: dict[str, Any], name: str) -> None:
    """Past the replicated norms, routers and rank 0's o_proj bias, a rank holds half of the
    weights where heads and experts split evenly (plus the zero rows padding an odd
    vocabulary, under 1%), and about its share of heads and expert rows otherwise; the two
    ranks' shares add up to the model."""
    tp1, ranks = runs[name]["tp1"], runs[name]["ranks"]
    shares = [rank["sharded"] / tp1["sharded"] for rank in ranks]
    tolerance = SHARE_TOLERANCE.get(name, 0.005)
    assert all(abs(share - 0.5) <= tolerance for share in shares), shares
    assert 1.0 <= sum(shares) <= 1.01, shares
    assert all(rank["replicated"] <= tp1["replicated"] for rank in ranks)


@pytest.mark.parametrize(("name", "rows"), [("mixtral", (24, 24)), ("qwen3_moe", (16, 17))])
def test_each_rank_holds_its_rows_of_every_expert(
    runs: dict[str, Any], name: str, rows: tuple[int, int]
) -> None:
    """Every expert's gate, up and down are split by inner rows, so a rank's expert bytes
    are its rows' share of the whole: half, or 16 and 17 of Qwen3-MoE's 33."""
    tp1, ranks = runs[name]["tp1"], runs[name]["ranks"]
    assert tp1["experts"] > 0
    inner = sum(rows)
    for rank, own in zip(ranks, rows, strict=True):
        assert rank["experts"] * inner == tp1["experts"] * own


# "The quick brown fox jumps over the lazy dog. The quick brown" in SmolLM2's vocabulary.
SMOLLM2_PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354]


def _gguf_rank_check(out: Path, group: TPGroup) -> None:
    result = _prefill_and_decode(resolve_model("SmolLM2-135M-Instruct"), group, SMOLLM2_PROMPT)
    torch.save(result, out / f"smollm2.rank{group.rank}.pt")


@pytest.mark.slow
def test_builtin_gguf_model_at_tp2(tmp_path: Path) -> None:
    """The built-in SmolLM2 GGUF (9 heads, 3 KV heads, Q/K rows unpermuted before slicing):
    rank 0's logits equal TP=1's on the same dequantized weights, and each rank holds
    40-60% of the weights that shard (measured 47% and 53%)."""
    errors = tmp_path / "errors"
    errors.mkdir()
    run_ranks(functools.partial(_gguf_rank_check, tmp_path), errors, timeout_s=120, wall_s=300)
    tp1 = _prefill_and_decode(resolve_model("SmolLM2-135M-Instruct"), None, SMOLLM2_PROMPT)
    ranks = [torch.load(tmp_path / f"smollm2.rank{r}.pt") for r in range(WORLD)]
    # 30 layers and logits up to ~31: measured 6e-5 apart, so a relative term joins 1e-4.
    for full, sharded in zip(tp1["logits"], ranks[0]["logits"], strict=True):
        torch.testing.assert_close(sharded, full, atol=1e-4, rtol=1e-5)
    shares = [rank["sharded"] / tp1["sharded"] for rank in ranks]
    assert all(0.4 <= share <= 0.6 for share in shares), shares


class _CountingSlice:
    """A lazy checkpoint tensor that counts the elements each index reads."""

    def __init__(self, source: TensorSource, counts: dict[str, int], name: str) -> None:
        self.source, self.counts, self.name = source, counts, name

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self.source[index]
        self.counts[self.name] = self.counts.get(self.name, 0) + part.numel()
        return part

    def get_shape(self) -> list[int]:
        shape: list[int] = self.source.get_shape()  # type: ignore[attr-defined]
        return shape


def _load_as_rank_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]
) -> tuple[dict[str, int], dict[str, int], torch.nn.Module]:
    """Save the tiny model `spec` describes and load it as rank 1 of 2 (loading needs no
    collective, so one process plays that rank): each checkpoint tensor's elements, the
    elements the rank read of each, and the rank's model."""
    spec = dict(spec)
    family = spec.pop("family")
    model_dir, _ = save_tiny_model(tmp_path / "model", family, **spec)
    stored = load_file(model_dir / "model.safetensors")
    full = {name: tensor.numel() for name, tensor in stored.items()}
    counts: dict[str, int] = {}
    slices = gpu_worker.loader.iter_hf_slices

    def counting(model_dir: Path) -> Iterator[tuple[str, TensorSource]]:
        for name, source in slices(model_dir):
            yield name, _CountingSlice(source, counts, name)

    monkeypatch.setattr(gpu_worker.loader, "iter_hf_slices", counting)
    group = TPGroup(rank=1, world_size=2, device=torch.device("cpu"), backend="gloo")
    model, _ = load_model(resolve_model(str(model_dir)), torch.device("cpu"), tp_group=group)
    return full, counts, model


def test_a_rank_reads_only_its_slice_of_each_safetensors_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading needs no collective, so one process plays rank 1 of 2: every tensor but the
    replicated norms (and the o_proj bias rank 1 drops) is read at most 2/3 (SmolLM2's
    shape gives rank 1 two of its 3 KV groups: 6 of 9 query heads), never whole."""
    spec = dict(MODELS["smollm2_shape"], attention_bias=True)
    full, counts, _ = _load_as_rank_1(tmp_path, monkeypatch, spec)
    for name, read in counts.items():
        if not name.endswith("norm.weight"):
            assert 3 * read <= 2 * full[name], (name, read, full[name])
    dropped = {name for name in full if name.endswith("o_proj.bias")}
    assert dropped
    assert set(counts) == set(full) - dropped


def test_a_rank_reads_only_its_rows_of_each_expert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expert tensors stack lazily: rank 1 of 2 reads 17 of the 33 inner rows of each
    expert's gate and up and 17 of the 33 columns of its down, each once; the router is
    read whole."""
    full, counts, model = _load_as_rank_1(tmp_path, monkeypatch, dict(MODELS["qwen3_moe"]))
    experts = [name for name in full if ".experts." in name]
    assert len(experts) == 8 * 3
    for name in experts:
        assert 33 * counts[name] == 17 * full[name], (name, counts[name], full[name])
    assert counts["model.layers.1.mlp.gate.weight"] == full["model.layers.1.mlp.gate.weight"]
    block = model.model.layers[1].mlp
    assert block.experts.gate_up_proj.shape == (8, 2 * 17, 64)
    assert block.experts.down_proj.shape == (8, 64, 17)
