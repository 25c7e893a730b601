"""Multi-LoRA under tensor parallelism: a TP=2 model (2 gloo ranks on CPU) with adapters in
its slots computes the TP=1 model's logits with the same adapters, row by row.

Each rank's slots hold its shard (`lora_targets`): q/k/v and gate/up keep A whole and
their rows of B, o and down their columns of A and B whole, adding the partial update
before the layer's one all-reduce. The SmolLM2-shaped Llama splits 9 query heads over 3 KV
heads unevenly over 2 ranks; a batch mixes base rows, a rank-16 adapter of every target and
a rank-8 one of q/v and down, through a prefill and a decode step.

Then the engine: `Engine(tensor_parallel_size=2, enable_lora=True, max_loras=1)` gives
TP=1's greedy tokens and logprobs for one prompt under the base model and each adapter,
the one slot refilled between them (the follower repeats rank 0's copies), and after an
unload and a load of the same name from another adapter's directory (the follower reads
the new one, not its copy of the old).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.sharding import local_heads
from gpu_worker.engine.engine import Completion, Engine
from gpu_worker.loader import load_model
from gpu_worker.lora.adapter import LORA_TARGETS, load_peft_adapter
from gpu_worker.lora.layers import attach_lora, lora_targets
from gpu_worker.lora.slots import LoRASlots
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.helpers.tiny_models import PagedRunner, save_tiny_model
from tests.integration.test_tp_collectives import run_ranks
from tests.unit.test_lora_adapter import AdapterSpec, add_peft_adapters

SPECS = {
    "alpha": AdapterSpec(16, 8, LORA_TARGETS, seed=1),
    "beta": AdapterSpec(8, 16, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=2),
}
MAX_LORA_RANK = 16
PROMPTS = {0: [3, 17, 42, 99, 7, 254, 128], 1: [5, 61, 9, 33], 2: [44, 2, 230, 18, 90]}
ADAPTER_OF_SEQ: dict[int, str | None] = {0: "alpha", 1: None, 2: "beta"}
DECODE = {0: [11], 1: [12], 2: [13]}


@torch.no_grad()
def _logits(model_dir: Path, adapters_dir: Path, group: TPGroup | None) -> list[torch.Tensor]:
    """Prefill then decode logits of the mixed batch, per sequence, on this rank."""
    source = resolve_model(str(model_dir))
    model, config = load_model(
        source, torch.device("cpu"), torch.float32, gguf_kernels=False, tp_group=group
    )
    adapters = {
        name: load_peft_adapter(name, adapters_dir / name, config, MAX_LORA_RANK) for name in SPECS
    }
    targets = lora_targets(model)
    slots = LoRASlots(
        len(SPECS),
        MAX_LORA_RANK,
        {key: target.shape for key, target in targets.items()},
        torch.device("cpu"),
        torch.float32,
        {key: target.shard for key, target in targets.items()},
    )
    state = attach_lora(model, slots)
    slot_of = slots.acquire(list(SPECS), adapters.__getitem__)
    if group is not None:
        heads = local_heads(config.num_heads, config.num_kv_heads, group.world_size, group.rank)
        config = dataclasses.replace(config, num_kv_heads=heads.num_kv_heads)
    runner = PagedRunner(model, config, block_size=4)
    results = []
    for batch in (PROMPTS, DECODE):
        rows = [
            -1 if ADAPTER_OF_SEQ[seq] is None else slot_of[str(ADAPTER_OF_SEQ[seq])]
            for seq, tokens in batch.items()
            for _ in tokens
        ]
        state.set_rows(torch.tensor(rows, dtype=torch.int32))
        logits = runner.step(batch)
        results.extend(logits[seq] for seq in batch)
    return results


def _rank_check(model_dir: Path, adapters_dir: Path, out: Path, group: TPGroup) -> None:
    logits = _logits(model_dir, adapters_dir, group)
    if group.is_driver:
        torch.save(logits, out / "rank0.pt")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The model's directory, its adapters' (one per SPECS name) and a scratch one."""
    root = tmp_path_factory.mktemp("tp_lora")
    model_dir, hf = save_tiny_model(
        root / "model",
        "llama",
        tie_word_embeddings=True,
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=255,
        tokenizer="words",
    )
    adapters_dir = root / "adapters"
    add_peft_adapters(hf, SPECS, adapters_dir)
    return model_dir, adapters_dir, root


@pytest.fixture(scope="module")
def runs(files: tuple[Path, Path, Path]) -> dict[str, list[torch.Tensor]]:
    model_dir, adapters_dir, root = files
    errors = root / "errors"
    errors.mkdir()
    run_ranks(
        functools.partial(_rank_check, model_dir, adapters_dir, root),
        errors,
        timeout_s=60.0,
        wall_s=120.0,
    )
    return {
        "tp1": _logits(model_dir, adapters_dir, None),
        "rank0": torch.load(root / "rank0.pt"),
        "base": _base_logits(model_dir),
    }


@torch.no_grad()
def _base_logits(model_dir: Path) -> list[torch.Tensor]:
    """The TP=1 model without adapters, to show the adapters change every adapted row."""
    model, config = load_model(
        resolve_model(str(model_dir)), torch.device("cpu"), torch.float32, gguf_kernels=False
    )
    runner = PagedRunner(model, config, block_size=4)
    return [logits for batch in (PROMPTS, DECODE) for logits in runner.step(batch).values()]


def test_tp2_with_adapters_matches_tp1(runs: dict[str, list[torch.Tensor]]) -> None:
    adapted = [name is not None for name in ADAPTER_OF_SEQ.values()] * 2
    # The logits head gathers the vocabulary shards on rank 0 alone.
    for got, expected in zip(runs["rank0"], runs["tp1"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    for got, base, has_adapter in zip(runs["tp1"], runs["base"], adapted, strict=True):
        moved = float((got - base).abs().max())
        assert moved > 0.05 if has_adapter else moved < 1e-5


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
ENGINE_PROMPT = PROMPTS[0]
ENGINE_ADAPTERS: list[str | None] = [None, "alpha", "beta"]


def _engine_runs(
    model_dir: Path, adapters_dir: Path, tensor_parallel_size: int
) -> list[Completion]:
    """The prompt under each of ENGINE_ADAPTERS in one batch, then under "alpha" alone
    (back into the slot "beta" took), then under "beta" reloaded from alpha's directory."""
    with Engine(
        model=str(model_dir),
        device="cpu",
        tensor_parallel_size=tensor_parallel_size,
        dist_timeout_s=30.0,
        kv_cache_memory_gb=0.01,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=MAX_LORA_RANK,
        lora_modules=[f"{name}={adapters_dir / name}" for name in SPECS],
        lora_root=adapters_dir,
    ) as engine:
        mixed = engine.generate([ENGINE_PROMPT] * 3, GREEDY, lora_names=ENGINE_ADAPTERS)
        again = engine.generate([ENGINE_PROMPT], GREEDY, lora_names=["alpha"])
        assert engine.unload_lora("beta").ok
        assert engine.load_lora("beta", "alpha").ok
        reloaded = engine.generate([ENGINE_PROMPT], GREEDY, lora_names=["beta"])
        stats = engine.stats()
    # One slot: alpha, beta, alpha again, then the new beta; each switch an eviction.
    assert stats.lora_evictions >= 3, stats
    return mixed + again + reloaded


def _first_logprobs(completion: Completion) -> list[float]:
    assert completion.logprobs is not None
    return completion.logprobs[0].top_logprobs


@pytest.mark.timeout(120)
def test_tp2_engine_serves_each_rows_adapter_as_tp1_through_refills_and_reloads(
    files: tuple[Path, Path, Path],
) -> None:
    model_dir, adapters_dir, _ = files
    tp1 = _engine_runs(model_dir, adapters_dir, 1)
    tp2 = _engine_runs(model_dir, adapters_dir, 2)
    for full, sharded in zip(tp1, tp2, strict=True):
        assert sharded.token_ids == full.token_ids
        assert _first_logprobs(sharded) == pytest.approx(_first_logprobs(full), abs=1e-4, rel=0)
    base, alpha, beta, alpha_again, beta_as_alpha = tp2
    # Each row had its own model: the adapters move the first step's logprobs apart.
    firsts = [_first_logprobs(c) for c in (base, alpha, beta)]
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert firsts[i] != pytest.approx(firsts[j], abs=1e-3), (i, j)
    assert alpha_again.token_ids == alpha.token_ids
    assert beta_as_alpha.token_ids == alpha.token_ids
    assert _first_logprobs(beta_as_alpha) == pytest.approx(firsts[1], abs=1e-4, rel=0)
