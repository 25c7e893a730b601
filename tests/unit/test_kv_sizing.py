"""KV cache sizing: the budget arithmetic with numbers, the profiling run on a tiny model on
CPU (readings from a fake probe), the CPU engine's unchanged default, and on CUDA an engine
at --gpu-memory-utilization 0.95 running its largest steps under the cap."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from gpu_worker import Engine
from gpu_worker.engine import rank as rank_module
from gpu_worker.engine.profile_sampling import costliest_params, profile_sampling
from gpu_worker.runner.kv_budget import GIB, KVCacheBudgetError, MemoryUse, plan_kv_cache
from gpu_worker.runner.kv_caches import CPU_DEFAULT_KV_CACHE_GB, model_kv_bytes_per_block
from gpu_worker.runner.profiling import (
    AUTOTUNE_WORKSPACE_BYTES,
    GRAPH_ROW_BYTES,
    GRAPH_SEGMENT_BYTES,
    CudaMemoryProbe,
    ProfileShapes,
    block_table_bytes,
    graph_pool_estimate,
    prefill_steps,
    profile_memory,
)
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MIB = 1 << 20
PER_BLOCK = 3 * MIB

# ---- the arithmetic ---------------------------------------------------------------


def _memory(**overrides: int) -> MemoryUse:
    """An 80 GiB device with 10 GiB in use: 7.5 GiB weights, 0.5 GiB other torch, 2 GiB
    non-torch; 2 GiB activations, 0.25 GiB autotuning, 0.375 GiB graphs, 0.125 GiB block
    tables."""
    values = dict(
        total=80 * GIB,
        free=70 * GIB,
        torch_reserved=8 * GIB,
        weights=15 * GIB // 2,
        activation_peak=2 * GIB,
        autotune_workspace=GIB // 4,
        graph_pool=GIB * 3 // 8,
        runner_buffers=GIB // 8,
    )
    return MemoryUse(**{**values, **overrides})


def test_measured_budget_is_the_cap_less_everything_else() -> None:
    budget = plan_kv_cache(
        PER_BLOCK, kv_cache_memory_gb=None, gpu_memory_utilization=0.9, memory=_memory()
    )
    # 72 GiB cap - 10 GiB in use - 2.75 GiB reserved = 59.25 GiB.
    assert budget.num_blocks == int(59.25 * GIB) // PER_BLOCK
    higher = plan_kv_cache(
        PER_BLOCK, kv_cache_memory_gb=None, gpu_memory_utilization=0.95, memory=_memory()
    )
    assert higher.num_blocks == (int(59.25 * GIB) + 4 * GIB) // PER_BLOCK
    exactly_one = _memory(
        free=10 * GIB + PER_BLOCK, graph_pool=0, autotune_workspace=0, runner_buffers=0
    )
    assert (
        plan_kv_cache(
            PER_BLOCK, kv_cache_memory_gb=None, gpu_memory_utilization=0.9, memory=exactly_one
        ).num_blocks
        == 1
    )
    lines = budget.lines()
    assert lines[0] == "GPU memory budget for the KV cache:"
    expected = {
        "total device memory": "80.00 GiB",
        "cap (--gpu-memory-utilization 0.9)": "72.00 GiB",
        "- weights": "7.50 GiB",
        "- other torch memory": "0.50 GiB",
        "- non-torch memory": "2.00 GiB",
        "- activation peak": "2.00 GiB",
        "- autotune workspace": "0.25 GiB",
        "- CUDA graph pool (estimate)": "0.38 GiB",
        "- runner buffers (block tables)": "0.12 GiB",
        "= KV cache": f"59.25 GiB -> {budget.num_blocks} blocks of 3.00 MiB",
    }
    assert len(lines) == 1 + len(expected)
    for line, (name, value) in zip(lines[1:], expected.items(), strict=True):
        assert line.strip().startswith(name)
        assert value in line


def test_explicit_size_ignores_the_readings() -> None:
    budget = plan_kv_cache(
        PER_BLOCK, kv_cache_memory_gb=1.5, gpu_memory_utilization=0.9, memory=_memory()
    )
    assert budget.num_blocks == 512
    assert budget.kv_cache_bytes == int(1.5 * GIB)
    assert budget.memory is None
    assert budget.lines() == [
        "KV cache (explicit --kv-cache-memory-gb, or the CPU default): "
        "1.50 GiB -> 512 blocks of 3.00 MiB"
    ]
    # Never zero blocks, however small the size.
    tiny = plan_kv_cache(
        PER_BLOCK, kv_cache_memory_gb=1e-9, gpu_memory_utilization=0.9, memory=None
    )
    assert tiny.num_blocks == 1


@pytest.mark.parametrize(
    ("utilization", "overrides"),
    [
        (0.1, {}),  # the cap (8 GiB) is below what is already in use (10 GiB)
        (0.9, {"activation_peak": 62 * GIB}),  # activations take all that is left
        # One byte short of one block: 72 - (70 - block + 1) - 2 GiB.
        (
            0.9,
            {
                "free": 10 * GIB + PER_BLOCK - 1,
                "graph_pool": 0,
                "autotune_workspace": 0,
                "runner_buffers": 0,
            },
        ),
    ],
)
def test_no_room_names_the_flags_to_change(utilization: float, overrides: dict[str, int]) -> None:
    memory = _memory(**overrides)
    with pytest.raises(KVCacheBudgetError) as error:
        plan_kv_cache(
            PER_BLOCK, kv_cache_memory_gb=None, gpu_memory_utilization=utilization, memory=memory
        )
    message = str(error.value)
    for flag in (
        "--gpu-memory-utilization",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--cuda-graph-max-batch-size",
        "--enforce-eager",
        "--kv-cache-memory-gb",
    ):
        assert flag in message


def test_out_of_range_settings_are_refused() -> None:
    for utilization in (0.0, 1.01):
        with pytest.raises(ValueError, match="--gpu-memory-utilization"):
            plan_kv_cache(
                PER_BLOCK,
                kv_cache_memory_gb=None,
                gpu_memory_utilization=utilization,
                memory=_memory(),
            )
    with pytest.raises(ValueError, match="--kv-cache-memory-gb"):
        plan_kv_cache(PER_BLOCK, kv_cache_memory_gb=0, gpu_memory_utilization=0.9, memory=None)


def test_largest_prefill_steps() -> None:
    big = ProfileShapes(
        max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192, block_size=16
    )
    assert prefill_steps(big) == [[8] * 256, [2048]]
    # Uneven splits go to the first sequences; one chunk is capped by max_model_len.
    odd = ProfileShapes(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=3, block_size=16)
    assert prefill_steps(odd) == [[3, 3, 2, 2], [3]]
    # The budget past what max_num_seqs sequences can hold is not a real step.
    capped = ProfileShapes(
        max_num_seqs=2, max_num_batched_tokens=100, max_model_len=8, block_size=4
    )
    assert prefill_steps(capped) == [[8, 8], [8]]
    one = ProfileShapes(
        max_num_seqs=1, max_num_batched_tokens=512, max_model_len=4096, block_size=16
    )
    assert prefill_steps(one) == [[512]]


def test_graph_pool_and_block_table_estimates() -> None:
    shapes = ProfileShapes(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=16,
        graph_batch_size=8,
    )
    # Buckets 1, 2, 4, 8: the smaller three keep [b, 4] fp32 outputs; static inputs of 8
    # rows with 4-block tables.
    static = 8 * 4 * 4 + 8 * GRAPH_ROW_BYTES
    expected = 1000 + 7 * 4 * 4 + 4 * GRAPH_SEGMENT_BYTES + static
    assert graph_pool_estimate(1000, shapes, 4, torch.float32) == expected
    eager = ProfileShapes(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=16
    )
    assert graph_pool_estimate(1000, eager, 4, torch.float32) == 0
    # Up to 2 x 9 rows (row 0 is padding) of 2 x 4 int32 columns, as the table doubles.
    assert block_table_bytes(eager) == 2 * 9 * 2 * 4 * 4


# ---- the profiling run on CPU -------------------------------------------------------


class FakeProbe:
    """Scripted readings: each step's peak is the next of `peaks` above 1 GiB reserved."""

    def __init__(self, peaks: list[int]) -> None:
        self.peaks = list(peaks)
        self.resets = 0
        self.current_peak = 0

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        # A quarter of the free memory caps the temporary cache: 4 MiB here.
        return 16 * MIB, 40 * GIB

    def memory_reserved(self) -> int:
        return GIB

    def reset_peak(self) -> None:
        self.resets += 1
        self.current_peak = GIB + self.peaks.pop(0)

    def max_memory_reserved(self) -> int:
        return self.current_peak


def test_profile_runs_the_largest_steps_on_cpu(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(model=str(tiny_llama_dir), device="cpu", kv_cache_memory_gb=0.01)
    mc = engine.model_config
    forwards: list[tuple[int, int, int]] = []

    def record(_module: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        input_ids, positions, meta, _ = args
        assert output.shape == (len(input_ids), mc.hidden_size)
        forwards.append((len(input_ids), meta.num_seqs, int(positions.max()) + 1))

    sampled: list[int] = []
    released: list[list[str]] = []
    sampler = engine.sampler
    sample, release = sampler.sample, sampler.release

    def spy_sample(logits: torch.Tensor, states: list[Any]) -> Any:
        sampled.append(len(states))
        return sample(logits, states)

    def spy_release(request_ids: list[str]) -> None:
        released.append(request_ids)
        release(request_ids)

    monkeypatch.setattr(sampler, "sample", spy_sample)
    monkeypatch.setattr(sampler, "release", spy_release)
    handle = engine.model.register_forward_hook(record)
    shapes = ProfileShapes(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=64,
        block_size=16,
        graph_batch_size=4,
    )
    post = profile_sampling(engine.sampler, engine.model.compute_logits, mc.vocab_size, 16)
    probe = FakeProbe([5 * MIB, 7 * MIB, 3 * MIB, 2 * MIB])
    try:
        memory = profile_memory(
            engine.model,
            mc,
            shapes,
            post,
            probe,
            dtype=torch.float32,
            device=engine.device,
            autotunes=True,
        )
    finally:
        handle.remove()
    # Prefill of 24 tokens over 4 sequences, then in one chunk, each ending at position 63;
    # a decode of 4 sequences with the sampler; the graph batch's forward alone.
    assert forwards == [(24, 4, 64), (24, 1, 64), (4, 4, 64), (4, 4, 64)]
    assert sampled == [4, 1, 4]
    assert released == [[f"profile-{i}" for i in range(n)] for n in sampled]
    assert probe.resets == 4
    assert memory.activation_peak == 7 * MIB
    assert memory.graph_pool == graph_pool_estimate(2 * MIB, shapes, mc.hidden_size, torch.float32)
    assert memory.autotune_workspace == AUTOTUNE_WORKSPACE_BYTES
    assert memory.runner_buffers == block_table_bytes(shapes)
    assert (memory.total, memory.free, memory.torch_reserved) == (40 * GIB, 16 * MIB, GIB)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert memory.weights >= weights


def test_cpu_engine_keeps_its_default_and_does_not_profile(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the CPU engine must not run a profiling forward")

    monkeypatch.setattr(rank_module, "profile_memory", refuse)
    caplog.set_level(logging.INFO, logger="gpu_worker.runner.kv_caches")
    engine = Engine(model=str(tiny_llama_dir), device="cpu")
    per_block = model_kv_bytes_per_block(engine.model_config, 16, torch.float32)
    assert engine.kv.num_blocks == int(CPU_DEFAULT_KV_CACHE_GB * GIB) // per_block
    assert f"-> {engine.kv.num_blocks} blocks" in caplog.text


# ---- CUDA ------------------------------------------------------------------------


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: profiles and sizes real GPU memory")
    return torch.device("cuda")


@pytest.mark.cuda
def test_cuda_probe_reads_the_allocator(cuda: torch.device) -> None:
    probe = CudaMemoryProbe(cuda)
    probe.empty_cache()
    probe.reset_peak()
    before = probe.memory_reserved()
    free_before, total = probe.mem_get_info()
    block = torch.empty(256 * MIB, dtype=torch.uint8, device=cuda)
    probe.synchronize()
    assert probe.memory_reserved() >= before + 256 * MIB
    assert probe.mem_get_info()[0] <= free_before - 256 * MIB
    del block
    probe.empty_cache()
    assert probe.max_memory_reserved() >= before + 256 * MIB
    assert probe.memory_reserved() < before + 256 * MIB
    assert probe.mem_get_info()[1] == total


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_engine_at_095_runs_its_largest_steps_under_the_cap(
    cuda: torch.device, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # SmolLM2-135M's shapes on 4 layers: a 49k vocabulary makes the sampler's buffers real.
    out_dir, _ = save_tiny_model(
        tmp_path,
        "llama",
        tie_word_embeddings=True,
        tokenizer="words",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
    )
    caplog.set_level(logging.INFO, logger="gpu_worker.runner.kv_caches")
    engine = Engine(model=str(out_dir), device="cuda", gpu_memory_utilization=0.95)
    lines = [r.getMessage() for r in caplog.records if r.name == "gpu_worker.runner.kv_caches"]
    assert lines[0] == "GPU memory budget for the KV cache:"
    assert "cap (--gpu-memory-utilization 0.95)" in lines[2]
    assert lines[-1].strip().startswith("= KV cache")
    assert f"-> {engine.kv.num_blocks} blocks" in lines[-1]

    torch.cuda.reset_peak_memory_stats(cuda)
    # The step budget (2048) in one prefill chunk, then all max_num_seqs (256) decoding.
    prompts = [[(7 * i + 3) % 49152 for i in range(2048)]]
    prompts += [[(row * 13 + i) % 49152 for i in range(8)] for row in range(255)]
    params = [
        msgspec.structs.replace(costliest_params(row), max_tokens=8, ignore_eos=True)
        for row in range(len(prompts))
    ]
    try:
        completions = engine.generate(prompts, params)
        assert [len(c.token_ids) for c in completions] == [8] * len(prompts)
        free, total = torch.cuda.mem_get_info(cuda)
        non_torch = (total - free) - torch.cuda.memory_reserved(cuda)
        assert torch.cuda.max_memory_reserved(cuda) + non_torch <= 0.95 * total
    finally:
        # The cache holds most of the device: give it back to the tests after this one.
        del engine
        gc.collect()
        torch.cuda.empty_cache()
