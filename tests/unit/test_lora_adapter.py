"""PEFT adapters: where they may load from, what they may hold, and how they load (CPU, fp32)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import save_file

from gpu_worker.lora.adapter import LORA_TARGETS, LoRAAdapter, load_peft_adapter, target_shapes
from gpu_worker.lora.paths import (
    InvalidLoRAError,
    LoRAError,
    LoRANotFoundError,
    resolve_adapter_dir,
)
from gpu_worker.lora.slots import LoRASlots, TooManyLoRAsError
from gpu_worker.models.config import ModelConfig
from tests.helpers.lora_adapters import AdapterSpec, add_peft_adapters
from tests.helpers.tiny_models import save_tiny_model


def _config(hf: transformers.PreTrainedModel) -> ModelConfig:
    c = hf.config
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=10000.0,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PeftModel, ModelConfig]:
    """A LoRA root with PEFT's own save of two adapters of the tiny Llama."""
    root = tmp_path_factory.mktemp("loras")
    _, hf = save_tiny_model(root.parent / "tiny-llama", "llama", tie_word_embeddings=True)
    config = _config(hf)
    specs = {
        "qv": AdapterSpec(8, 16, ("q_proj", "v_proj"), seed=1),
        "all": AdapterSpec(16, 8, LORA_TARGETS, use_rslora=True, seed=2),
    }
    return root, add_peft_adapters(hf, specs, root), config


# ---- paths -------------------------------------------------------------------------------


def test_resolves_an_adapter_inside_the_root_by_relative_or_absolute_path(
    saved: tuple[Path, PeftModel, ModelConfig],
) -> None:
    root, _, _ = saved
    assert resolve_adapter_dir("qv", root) == (root / "qv").resolve()
    assert resolve_adapter_dir(str(root / "all"), root) == (root / "all").resolve()
    # A symlink that stays inside the root is followed.
    link = root / "alias"
    if not link.exists():
        link.symlink_to(root / "qv")
    assert resolve_adapter_dir("alias", root) == (root / "qv").resolve()


@pytest.mark.parametrize(
    "path",
    ["https://example.com/adapter", "s3://bucket/adapter", "file:///etc", "hf://org/name"],
)
def test_urls_are_refused(saved: tuple[Path, PeftModel, ModelConfig], path: str) -> None:
    root, _, _ = saved
    with pytest.raises(InvalidLoRAError, match="URL") as refused:
        resolve_adapter_dir(path, root)
    assert refused.value.status == 400


def test_escapes_are_refused_whether_or_not_the_target_exists(
    saved: tuple[Path, PeftModel, ModelConfig], tmp_path: Path
) -> None:
    root, _, _ = saved
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text('{"secret": "do not echo"}')
    (outside / "adapter_model.safetensors").write_bytes(b"x")
    escape = root / "escape"
    escape.symlink_to(outside)
    # A PEFT file inside the root that links out is an escape too.
    linked_files = root / "linked-files"
    linked_files.mkdir()
    (linked_files / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    (linked_files / "adapter_model.safetensors").write_bytes(b"x")
    # The root and tmp_path are siblings under pytest's base directory.
    for path in [
        f"../{tmp_path.name}/outside",
        f"qv/../../{tmp_path.name}/outside",
        str(outside),
        "/etc",
        "/nonexistent/adapter",
        "escape",
        "escape/",
        "linked-files",
    ]:
        with pytest.raises(InvalidLoRAError, match="outside the LoRA root") as refused:
            resolve_adapter_dir(path, root)
        assert refused.value.status == 400
        assert "secret" not in refused.value.message
        assert str(outside) not in refused.value.message or path == str(outside)


def test_missing_directories_and_files_are_404(
    saved: tuple[Path, PeftModel, ModelConfig],
) -> None:
    root, _, _ = saved
    no_weights = root / "no-weights"
    no_weights.mkdir(exist_ok=True)
    (no_weights / "adapter_config.json").write_text("{}")
    cases = {"missing": "no adapter directory", "no-weights": "no adapter_model.safetensors"}
    for path, message in cases.items():
        with pytest.raises(LoRANotFoundError, match=message) as refused:
            resolve_adapter_dir(path, root)
        assert refused.value.status == 404
    with pytest.raises(LoRANotFoundError, match="lora-root"):
        resolve_adapter_dir("qv", root / "no-such-root")


def test_paths_need_a_root(saved: tuple[Path, PeftModel, ModelConfig]) -> None:
    root, _, _ = saved
    with pytest.raises(InvalidLoRAError, match="--lora-root"):
        resolve_adapter_dir(str(root / "qv"), None)
    with pytest.raises(InvalidLoRAError, match="empty"):
        resolve_adapter_dir("", root)


# ---- loading -----------------------------------------------------------------------------


def test_loads_peft_saved_adapters_with_their_weights_and_scales(
    saved: tuple[Path, PeftModel, ModelConfig],
) -> None:
    root, peft_model, config = saved
    qv = load_peft_adapter("qv", resolve_adapter_dir("qv", root), config, max_lora_rank=16)
    assert (qv.rank, qv.scale, qv.target_modules) == (8, 2.0, frozenset({"q_proj", "v_proj"}))
    assert set(qv.weights) == {(layer, t) for layer in range(2) for t in ("q_proj", "v_proj")}
    everything = load_peft_adapter("all", root / "all", config, max_lora_rank=16)
    assert everything.scale == 8 / 4  # rsLoRA: alpha / sqrt(16)
    assert everything.target_modules == frozenset(LORA_TARGETS)
    assert len(everything.weights) == 2 * len(LORA_TARGETS)
    # The very tensors PEFT holds, in PEFT's layout.
    layer: Any = cast(Any, peft_model).base_model.model.model.layers[1]
    a, b = everything.weights[(1, "down_proj")]
    assert torch.equal(a, layer.mlp.down_proj.lora_A["all"].weight)
    assert torch.equal(b, layer.mlp.down_proj.lora_B["all"].weight)
    assert a.dtype == b.dtype == torch.float32
    assert not bool((b == 0).all())


def _rewrite(src: Path, dst: Path, config_changes: dict[str, Any] | None = None) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": 32}, "exceeds --max-lora-rank 16"),
        ({"r": 0}, "r must be a positive integer"),
        ({"bias": "all"}, "bias 'none'"),
        ({"use_dora": True}, "DoRA"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head' is not supported"),
        ({"target_modules": ["embed_tokens"]}, "'embed_tokens' is not supported"),
        ({"peft_type": "IA3"}, "only LoRA"),
        ({"r": 4}, r"lora_A \(4, 64\)|do not fit"),  # the tensors are rank 8
    ],
)
def test_unsupported_configs_are_refused(
    saved: tuple[Path, PeftModel, ModelConfig],
    tmp_path: Path,
    changes: dict[str, Any],
    message: str,
) -> None:
    root, _, config = saved
    changed = _rewrite(root / "qv", tmp_path / "changed", changes)
    with pytest.raises(InvalidLoRAError, match=message) as refused:
        load_peft_adapter("changed", changed, config, max_lora_rank=16)
    assert refused.value.status == 400


L0 = "base_model.model.model.layers.0."
L5 = "base_model.model.model.layers.5."


def _with_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": "^.*proj$"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            {"base_model.model.lm_head.lora_A.weight": torch.ones(8, 64)},
            "module 'lm_head' is not supported",
        ),
        (
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 256)},
            "module 'model.embed_tokens' is not supported",
        ),
        (
            {L0 + "mlp.experts.3.up_proj.lora_A.weight": torch.ones(8, 64)},
            "'model.layers.0.mlp.experts.3.up_proj' is not supported",
        ),
        (
            {L0 + "self_attn.q_proj.lora_A.weight": torch.ones(8, 64)},
            "lora_A without lora_B",
        ),
        (
            {
                L5 + "self_attn.q_proj.lora_A.weight": torch.ones(8, 64),
                L5 + "self_attn.q_proj.lora_B.weight": torch.ones(64, 8),
            },
            "layer 5 q_proj: no such projection",
        ),
        (
            {
                L0 + "self_attn.k_proj.lora_A.default.weight": torch.ones(8, 64),
                L0 + "self_attn.k_proj.lora_B.default.weight": torch.ones(64, 8),
            },
            r"do not fit the model \(8, 64\) and \(32, 8\)",
        ),
        (
            {
                L0 + "self_attn.k_proj.lora_A.weight": torch.ones(8, 64),
                L0 + "self_attn.k_proj.lora_B.weight": torch.full((32, 8), float("inf")),
            },
            "inf or NaN",
        ),
        ({}, "holds no LoRA weights"),
    ],
    ids=["lm-head", "embedding", "moe-expert", "half", "layer", "shape", "inf", "empty"],
)
def test_unsupported_tensors_are_refused(
    saved: tuple[Path, PeftModel, ModelConfig],
    tmp_path: Path,
    tensors: dict[str, torch.Tensor],
    message: str,
) -> None:
    _, _, config = saved
    directory = _with_tensors(tmp_path / "adapter", tensors)
    with pytest.raises(InvalidLoRAError, match=message):
        load_peft_adapter("bad", directory, config, max_lora_rank=16)


def test_unreadable_files_are_refused_without_echoing_them(
    saved: tuple[Path, PeftModel, ModelConfig], tmp_path: Path
) -> None:
    root, _, config = saved
    not_json = _rewrite(root / "qv", tmp_path / "not-json")
    (not_json / "adapter_config.json").write_text("secret-token {")
    not_safetensors = _rewrite(root / "qv", tmp_path / "not-safetensors")
    (not_safetensors / "adapter_model.safetensors").write_bytes(b"secret-token" * 8)
    for directory, message in [(not_json, "not a readable JSON"), (not_safetensors, "valid")]:
        with pytest.raises(LoRAError, match=message) as refused:
            load_peft_adapter("bad", directory, config, max_lora_rank=16)
        assert "secret" not in str(refused.value)


# ---- slots -------------------------------------------------------------------------------


def _adapter(
    name: str, rank: int, shapes: Mapping[tuple[int, str], tuple[int, int]]
) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(rank)
    weights = {
        key: (torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen))
        for key, (i, o) in shapes.items()
    }
    return LoRAAdapter(name, rank, 0.5, frozenset(t for _, t in shapes), weights)


def test_a_slot_holds_its_adapter_zero_padded_and_nothing_of_the_previous_one() -> None:
    shapes = {(0, "q_proj"): (6, 5), (0, "down_proj"): (4, 6)}
    slots = LoRASlots(1, 4, shapes, torch.device("cpu"), torch.float32)
    addresses = [(a.data_ptr(), b.data_ptr()) for a, b in slots.stacks.values()]
    wide = _adapter("wide", 4, shapes)
    assert slots.activate(wide) == 0
    narrow = _adapter("narrow", 2, {(0, "q_proj"): (6, 5)})
    assert slots.activate(narrow) == 0  # evicts "wide"
    a_stack, b_stack = slots.stacks[(0, "q_proj")]
    a, b = narrow.weights[(0, "q_proj")]
    assert torch.equal(a_stack[0, :2], a)
    assert not a_stack[0, 2:].any()
    assert torch.equal(b_stack[0, :, :2], b)
    assert not b_stack[0, :, 2:].any()
    # The target the new adapter lacks holds zeros, not the old adapter's weights.
    assert not any(t.any() for t in slots.stacks[(0, "down_proj")])
    assert [(a.data_ptr(), b.data_ptr()) for a, b in slots.stacks.values()] == addresses
    assert (slots.resident, slots.num_loads, slots.num_evictions) == (["narrow"], 2, 1)
    assert slots.remove("narrow")
    assert not slots.remove("narrow")
    assert not a_stack.any()
    assert float(slots.scales[0]) == 0.0


def test_acquire_loads_missing_adapters_and_evicts_the_least_recently_used() -> None:
    shapes = {(0, "v_proj"): (4, 4)}
    slots = LoRASlots(2, 4, shapes, torch.device("cpu"), torch.float32)
    loaded: list[str] = []

    def load(name: str) -> LoRAAdapter:
        loaded.append(name)
        return _adapter(name, 2, shapes)

    first = slots.acquire(["a", "b", "a"], load)
    assert dict(first) == {"a": 0, "b": 1}
    slots.acquire(["a"], load)  # "a" becomes the most recently used: "b" goes next
    assert dict(slots.acquire(["c"], load)) == {"c": 1}
    assert (loaded, slots.num_evictions, slots.resident) == (["a", "b", "c"], 1, ["a", "c"])
    # A step's own adapters are pinned: loading "b" for it evicts "c", not "a".
    assert dict(slots.acquire(["a", "b"], load)) == {"a": 0, "b": 1}
    assert slots.num_evictions == 2
    with pytest.raises(TooManyLoRAsError):
        slots.acquire(["a", "b", "c"], load)
    assert slots.num_loads == 4


def test_target_shapes_leave_out_the_mlp_of_moe_layers() -> None:
    dense = _config_like(num_layers=2)
    moe = dataclasses.replace(dense, num_experts=4, num_experts_per_tok=2, dense_layers=(1,))
    assert len(target_shapes(dense)) == 14
    assert {t for layer, t in target_shapes(moe) if layer == 0} == set(LORA_TARGETS[:4])
    assert {t for layer, t in target_shapes(moe) if layer == 1} == set(LORA_TARGETS)


def _config_like(num_layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
