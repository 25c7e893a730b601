"""Our model with LoRA slots against transformers + PEFT: one batch mixing base rows and the
rows of two adapters gives each row its own model's logits and greedy tokens (CPU, fp32)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from peft import PeftModel

from gpu_worker.loader import load_model
from gpu_worker.lora.adapter import LORA_TARGETS, LoRAAdapter, load_peft_adapter, target_shapes
from gpu_worker.lora.layers import LoRAState, attach_lora
from gpu_worker.lora.slots import LoRASlots
from gpu_worker.models import LlamaForCausalLM
from gpu_worker.models.config import ModelConfig
from shared.model_source import resolve_model
from tests.helpers.lora_adapters import AdapterSpec, add_peft_adapters
from tests.helpers.tiny_models import PagedRunner, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = {
    "qv": AdapterSpec(8, 16, ("q_proj", "v_proj"), seed=1),
    "all": AdapterSpec(16, 8, LORA_TARGETS, use_rslora=True, seed=2),
    # Not "mlp": PEFT files an adapter's tensors by its name within their names, and ".mlp."
    # would take every other adapter's MLP tensors.
    "gd": AdapterSpec(4, 8, ("gate_proj", "down_proj"), seed=3),
}
MAX_LORA_RANK = 16


@dataclasses.dataclass
class Served:
    """Our model with LoRA slots beside PEFT over the same weights and adapters."""

    ours: LlamaForCausalLM
    config: ModelConfig
    state: LoRAState
    adapters: dict[str, LoRAAdapter]
    peft: PeftModel

    def load(self, name: str) -> LoRAAdapter:
        return self.adapters[name]


def _serve(
    ours: LlamaForCausalLM, config: ModelConfig, hf: transformers.PreTrainedModel, out: Path
) -> Served:
    peft = add_peft_adapters(hf, SPECS, out)
    adapters = {name: load_peft_adapter(name, out / name, config, MAX_LORA_RANK) for name in SPECS}
    slots = LoRASlots(2, MAX_LORA_RANK, target_shapes(config), torch.device("cpu"), torch.float32)
    return Served(ours, config, attach_lora(ours, slots), adapters, peft)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    out = tmp_path_factory.mktemp(request.param)
    model_dir, hf = save_tiny_model(out / "model", request.param, tie_word_embeddings=False)
    ours, config = load_model(resolve_model(str(model_dir)), torch.device("cpu"))
    assert isinstance(ours, LlamaForCausalLM)
    return _serve(ours, config, hf, out / "adapters")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, hf_reference_model: Any) -> Served:
    source = resolve_model("SmolLM2-135M-Instruct")
    ours, config = load_model(source, torch.device("cpu"))
    assert isinstance(ours, LlamaForCausalLM)
    # Drop the GGUF blocks' fast path: its rounding differs from transformers' dequantized
    # fp32 by ~1e-4 on its own (test_loader holds the base model to 1e-3), which would hide
    # the adapters' 1e-4 here. Both sides then multiply the same dequantized weights.
    ours.build_caches(torch.device("cpu"))
    # PEFT injects its layers into the model it wraps: a copy, not the shared reference.
    hf = copy.deepcopy(hf_reference_model)
    return _serve(ours, config, hf, tmp_path_factory.mktemp("smollm2-adapters"))


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _row_slots(batch: Mapping[int, list[int]], slot_of_seq: Mapping[int, int]) -> torch.Tensor:
    rows = [slot_of_seq[seq] for seq, tokens in batch.items() for _ in tokens]
    return torch.tensor(rows, dtype=torch.int32)


@contextlib.contextmanager
def _peft_as(peft: PeftModel, name: str | None) -> Iterator[None]:
    """PEFT with adapter `name` active, or the base model alone for None."""
    if name is None:
        with peft.disable_adapter():
            yield
    else:
        peft.set_adapter(name)
        yield


@torch.no_grad()
def _peft_logits(peft: PeftModel, name: str | None, tokens: list[int]) -> torch.Tensor:
    with _peft_as(peft, name):
        logits: torch.Tensor = peft(input_ids=torch.tensor([tokens])).logits[0]
    return logits.float()


@torch.no_grad()
def _peft_greedy(peft: PeftModel, name: str | None, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_peft_logits(peft, name, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _check_mixed_batch(served: Served, prompt_len: int, steps: int) -> None:
    """Sequences of the base model, "qv" and "all" interleaved in one batch: prefill logits
    within 1e-4 of PEFT's per row, then greedy decode steps of the whole batch equal."""
    slots = served.state.slots
    slot_of = slots.acquire(["qv", "all"], served.load)
    adapter_of_seq: dict[int, str | None] = {0: "qv", 1: None, 2: "all", 3: "qv"}
    slot_of_seq = {
        seq: -1 if name is None else slot_of[name] for seq, name in adapter_of_seq.items()
    }
    vocab = served.config.vocab_size
    batch = {seq: _prompt(seq, prompt_len + seq, vocab) for seq in adapter_of_seq}
    runner = PagedRunner(served.ours, served.config, num_blocks=64, block_size=4)
    served.state.set_rows(_row_slots(batch, slot_of_seq))
    logits = runner.step(batch)
    base = {seq: _peft_logits(served.peft, None, batch[seq]) for seq in batch}
    for seq, name in adapter_of_seq.items():
        expected = _peft_logits(served.peft, name, batch[seq])
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=0)
        if name is not None:  # the adapter moves the logits far past the tolerance
            assert (expected - base[seq]).abs().max() > 0.05
    generated = {seq: [int(logits[seq][-1].argmax())] for seq in batch}
    for _ in range(steps - 1):
        step = {seq: tokens[-1:] for seq, tokens in generated.items()}
        served.state.set_rows(_row_slots(step, slot_of_seq))
        for seq, out in runner.step(step).items():
            generated[seq].append(int(out[-1].argmax()))
    for seq, name in adapter_of_seq.items():
        assert generated[seq] == _peft_greedy(served.peft, name, batch[seq], steps), seq


def test_mixed_batch_matches_peft_per_row(tiny: Served) -> None:
    _check_mixed_batch(tiny, prompt_len=7, steps=6)


@pytest.mark.slow  # SmolLM2 in our loader and in transformers (~25 s)
def test_smollm2_mixed_batch_matches_peft_per_row(smollm2: Served) -> None:
    _check_mixed_batch(smollm2, prompt_len=9, steps=4)


def test_a_base_only_step_skips_the_adapters(tiny: Served) -> None:
    """All rows -1 set no state at all, and the logits are the base model's."""
    tiny.state.slots.acquire(["all"], tiny.load)
    tokens = _prompt(9, 6, tiny.config.vocab_size)
    tiny.state.set_rows(torch.full((len(tokens),), -1, dtype=torch.int32))
    assert tiny.state.row_slots is None
    got = PagedRunner(tiny.ours, tiny.config).step({0: tokens})[0]
    torch.testing.assert_close(got, _peft_logits(tiny.peft, None, tokens), atol=1e-4, rtol=0)


def test_an_evicted_slot_serves_its_new_adapter_only(tiny: Served) -> None:
    """Three adapters over two slots: "gd" takes the least recently used slot ("all"'s,
    whose attention targets it must zero), and a batch of "qv" and "gd" still matches."""
    slots = tiny.state.slots
    slots.acquire(["all", "qv"], tiny.load)
    evictions = slots.num_evictions
    slot_of = slots.acquire(["gd", "qv"], tiny.load)
    assert slots.num_evictions == evictions + 1
    assert sorted(slots.resident) == ["gd", "qv"]
    batch = {0: _prompt(20, 8, tiny.config.vocab_size), 1: _prompt(21, 5, tiny.config.vocab_size)}
    tiny.state.set_rows(_row_slots(batch, {0: slot_of["gd"], 1: slot_of["qv"]}))
    logits = PagedRunner(tiny.ours, tiny.config).step(batch)
    for seq, name in [(0, "gd"), (1, "qv")]:
        expected = _peft_logits(tiny.peft, name, batch[seq])
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=0)


def test_a_followers_slots_mirror_the_leaders_loads(tiny: Served) -> None:
    """A TP follower repeats its leader's `take_loads` with `fill`: the same adapters in the
    same slots, so the leader's per-row slots name the same adapters on every rank."""
    shapes = target_shapes(tiny.config)
    cpu = torch.device("cpu")
    leader = LoRASlots(2, MAX_LORA_RANK, shapes, cpu, torch.float32)
    follower = LoRASlots(2, MAX_LORA_RANK, shapes, cpu, torch.float32)
    leader.acquire(["qv", "gd"], tiny.load)
    first = leader.take_loads()
    assert sorted(first) == sorted((n, leader.slot_of(n)) for n in ("qv", "gd"))
    leader.acquire(["gd"], tiny.load)  # resident: no copy
    leader.acquire(["all"], tiny.load)  # evicts the least recently used, "qv"
    second = leader.take_loads()
    assert second == [("all", first[[n for n, _ in first].index("qv")][1])]
    for name, slot in first + second:
        follower.fill(tiny.adapters[name], slot)
    assert sorted(follower.resident) == sorted(leader.resident) == ["all", "gd"]
    assert all(follower.slot_of(n) == leader.slot_of(n) for n in leader.resident)
    for key, (a, b) in leader.stacks.items():
        assert torch.equal(follower.stacks[key][0], a)
        assert torch.equal(follower.stacks[key][1], b)
    assert torch.equal(follower.scales, leader.scales)
    assert leader.take_loads() == []
