"""`Engine(tensor_parallel_size=2)` on CPU: the engine spawns its second rank (gloo), leads
every step, and its greedy tokens are TP=1's. A follower killed mid-run makes the next
step raise an error naming it, and a bad configuration is refused before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.core.config import EngineConfig
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.executor import TPExecutor
from gpu_worker.engine.tp_worker import TPRankFailed, resolve_tp_config
from gpu_worker.loader import load_config
from gpu_worker.runner.kv_caches import kv_cache_bytes_per_block
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.helpers.preemption import count_preemptions
from tests.helpers.processes import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Two prompts share 2 full blocks of 16, so the second reuses the first's cached prefix.
SHARED = list(range(3, 35))
PROMPTS = [SHARED + [40, 41, 42], SHARED + [50, 51], [7, 8, 9, 10, 11]]


def _greedy(**engine_args: Any) -> tuple[list[list[int]], list[int]]:
    with Engine(device="cpu", **engine_args) as engine:
        first = engine.generate(PROMPTS[:1], GREEDY)
        rest = engine.generate(PROMPTS[1:], GREEDY)
    completions = first + rest
    return [c.token_ids for c in completions], [c.num_cached_tokens for c in completions]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import save_tiny_model  # transformers

    out_dir = tmp_path_factory.mktemp("tp_engine") / "qwen3"
    return save_tiny_model(out_dir, "qwen3", tie_word_embeddings=True, tokenizer="words").path


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_qwen3_tp2_greedy_equals_tp1_with_prefix_caching(tiny_qwen3: Path) -> None:
    tp1 = _greedy(model=str(tiny_qwen3))
    tp2 = _greedy(model=str(tiny_qwen3), tensor_parallel_size=2, dist_timeout_s=20.0)
    assert tp2 == tp1
    assert tp2[1][1] == 32, "the second batch reused the first prompt's two full blocks"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_qwen3_tp2_under_preemption_equals_tp1(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 blocks of 16 for 6 sequences of ~3 blocks each: rank 0 preempts and recomputes,
    and every rank's cache follows its block ids. The scheduler runs in this process."""
    preemptions = count_preemptions(monkeypatch)
    config = load_config(resolve_model(str(tiny_qwen3)))
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20 + i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    for size in (1, 2):
        # At TP=2 each rank holds one of the 2 KV heads: the same 8 blocks in half the bytes.
        local_kv_heads = config.num_kv_heads // size
        per_block = kv_cache_bytes_per_block(
            config.num_layers, 16, local_kv_heads, config.head_dim, torch.float32
        )
        args: dict[str, Any] = dict(
            tensor_parallel_size=size,
            kv_cache_memory_gb=8 * per_block / (1 << 30),
            enable_prefix_caching=False,
        )
        with Engine(model=str(tiny_qwen3), device="cpu", **args) as engine:
            assert engine.kv.num_blocks == 8
            preemptions.clear()
            tokens.append([c.token_ids for c in engine.generate(prompts, params)])
            assert preemptions, f"nothing was preempted at TP={size}"
    assert tokens[1] == tokens[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_builtin_smollm2_tp2_greedy_equals_tp1() -> None:
    """SmolLM2's 9 heads over 3 KV heads split unevenly between the 2 ranks."""
    tp1 = _greedy()
    tp2 = _greedy(tensor_parallel_size=2, dist_timeout_s=60.0)
    assert tp2[0] == tp1[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dead_follower_fails_the_next_step_naming_it(tiny_qwen3: Path) -> None:
    engine = Engine(model=str(tiny_qwen3), device="cpu", tensor_parallel_size=2)
    try:
        engine.generate(PROMPTS[2:], GREEDY)
        assert isinstance(engine.executor, TPExecutor)
        [follower] = engine.executor.leader.processes
        assert follower.pid is not None
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        with pytest.raises(TPRankFailed, match="tp-rank-1"):
            engine.generate(PROMPTS[2:], GREEDY)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_nodes_on_one_host(tiny_qwen3: Path) -> None:
    """Node 1 is `gpu-worker --node-rank 1` (its rank only follows, no socket); node 0 is
    the engine. Rank 0's stop message ends node 1's process with exit code 0."""
    tp1 = _greedy(model=str(tiny_qwen3))
    address = f"127.0.0.1:{free_port()}"
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", address]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "gpu_worker.cli", "--model", str(tiny_qwen3), "--device", "cpu"]
        + [*flags, "--node-rank", "1", "--log-level", "warning"]
    )
    try:
        tp2 = _greedy(
            model=str(tiny_qwen3), tensor_parallel_size=2, nnodes=2, dist_init_addr=address
        )
        assert node1.wait(30) == 0
    finally:
        node1.kill()
        node1.wait()
    assert tp2 == tp1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (dict(tensor_parallel_size=0), "must be positive"),
        (dict(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1"), "do not divide"),
        (dict(tensor_parallel_size=4, nnodes=2, node_rank=2, dist_init_addr="h:1"), "outside"),
        (dict(tensor_parallel_size=4, nnodes=2), "need dist_init_addr"),
        (dict(tensor_parallel_size=2, dist_timeout_s=0.0), "dist_timeout_s"),
        (
            dict(
                tensor_parallel_size=4,
                nnodes=2,
                node_rank=1,
                tp_rank_offset=3,
                dist_init_addr="h:1",
            ),
            "outside",
        ),
        (
            dict(
                tensor_parallel_size=4,
                nnodes=2,
                node_rank=1,
                tp_rank_offset=0,
                dist_init_addr="h:1",
            ),
            "node_rank 0",
        ),
    ],
)
def test_bad_parallel_configs_are_refused(args: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**args)


def test_tp_config_from_flags_and_from_torchrun() -> None:
    config = EngineConfig(
        tensor_parallel_size=8, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500"
    )
    tp = resolve_tp_config(config, {})
    assert (tp.rank, tp.tp_rank_offset, tp.nnodes, tp.dist_init_addr) == (
        4,
        4,
        2,
        "10.0.0.1:29500",
    )
    assert resolve_tp_config(EngineConfig(tensor_parallel_size=2), {}).address()[0] == "127.0.0.1"
    placed = EngineConfig(
        tensor_parallel_size=8, nnodes=4, node_rank=1, tp_rank_offset=6, dist_init_addr="h:1"
    )
    assert (resolve_tp_config(placed, {}).rank, resolve_tp_config(placed, {}).local_rank) == (6, 0)
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    from_env = resolve_tp_config(config, env)
    assert (from_env.tensor_parallel_size, from_env.dist_init_addr) == (2, "h:1234")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prompt_logprobs_at_tp2_equal_tp1(tiny_qwen3: Path) -> None:
    """Rank 0 scores the prompt rows while the follower joins each slice's logits gather;
    a chunked prompt (8-token budget) is scored chunk by chunk, as at TP=1."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    prompts = [PROMPTS[0], PROMPTS[2]]
    runs = []
    for size in (1, 2):
        with Engine(
            model=str(tiny_qwen3),
            device="cpu",
            tensor_parallel_size=size,
            max_num_batched_tokens=8,
            long_prefill_token_threshold=8,
        ) as engine:
            runs.append(engine.generate(prompts, params))
    for tp1, tp2 in zip(*runs, strict=True):
        assert tp2.token_ids == tp1.token_ids
        assert tp1.prompt_logprobs is not None
        assert tp2.prompt_logprobs is not None
        assert len(tp2.prompt_logprobs) == len(tp1.prompt_logprobs)
        for a, b in zip(tp1.prompt_logprobs[1:], tp2.prompt_logprobs[1:], strict=True):
            assert a is not None
            assert b is not None
            assert b.rank == a.rank
            assert b.top_token_ids == a.top_token_ids
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert b.top_logprobs == pytest.approx(a.top_logprobs, abs=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_follower_failing_at_start_up_is_reported_by_rank_0(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 joins, then cannot load its shard: rank 0's next collective fails at once,
    and the engine raises the follower's own error, naming its rank."""
    from gpu_worker.engine import tp_worker
    from tests.helpers.tp_faults import LOAD_ERROR, follower_failing_to_load

    monkeypatch.setattr(tp_worker, "follower_main", follower_failing_to_load)
    started = time.monotonic()
    with pytest.raises(TPRankFailed, match="rank 1 failed") as failure:
        Engine(model=str(tiny_qwen3), device="cpu", tensor_parallel_size=2, dist_timeout_s=60.0)
    assert LOAD_ERROR in str(failure.value)
    assert time.monotonic() - started < 30, "reported within seconds, not at the timeout"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, one per rank)")
@pytest.mark.timeout(600)
def test_cuda_tp2_profiles_each_rank_and_replays_graphs_with_the_all_reduce(
    tiny_qwen3: Path,
) -> None:
    """On NCCL: each rank sizes its cache from its own profiling run, captures its decode
    graphs (the all-reduces inside them), and greedy tokens equal TP=1's, the decode steps
    replayed from graphs on rank 0 (and, through the same batch, on rank 1)."""
    args: dict[str, Any] = dict(model=str(tiny_qwen3), attention_backend="triton")
    with Engine(device="cuda", **args) as engine:
        tp1 = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    with Engine(device="cuda", tensor_parallel_size=2, **args) as engine:
        tp2 = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        assert engine.runner.num_graph_steps > 0
    assert tp2 == tp1
