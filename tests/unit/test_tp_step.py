"""A TP step's wire (`gpu_worker.engine.tp_step`): what rank 0 prepares crosses whole, and a
runner that runs the received batch computes exactly what the preparing rank does.

A real scheduler drives the steps through what the wire must carry: chunked prefill beside
decodes, prompt-logprob rows, finished requests releasing rows, more sequences than the
block table's first rows and tables wider than its first columns (both tables grow).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.scheduler import Scheduler, SchedulerOutput
from gpu_worker.core.sequence import Sequence
from gpu_worker.distributed.group import TPGroup
from gpu_worker.engine import tp_step as step_module
from gpu_worker.engine.tp_step import (
    StepMessage,
    WireArray,
    decode_step,
    encode_step,
    encode_stop,
    follower_loop,
    lead_step,
    stop_followers,
)
from gpu_worker.models import LlamaForCausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.runner.kv_caches import allocate_kv_caches
from gpu_worker.runner.model_runner import HostBatch, ModelRunner
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
NUM_BLOCKS = 160
VOCAB = 64

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama on CPU, the same weights for the same seed in any process."""
    model = LlamaForCausalLM(CONFIG, TorchAttentionBackend())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model.build_caches(torch.device("cpu"))
    return model.eval()


def tiny_runner(model: LlamaForCausalLM | None) -> ModelRunner:
    """A runner with its own KV cache (host-side only without a model)."""
    if model is None:
        none = cast(Any, None)
        return ModelRunner(none, none, [], BS, torch.device("cpu"))
    shape = (NUM_BLOCKS, BS, CONFIG.num_kv_heads, CONFIG.head_dim)
    caches = allocate_kv_caches(CONFIG.num_layers, *shape, torch.float32, torch.device("cpu"))
    return ModelRunner(model, model.attn_backend, caches, BS, torch.device("cpu"))


def busy_scheduler(num_requests: int, seed: int = 0) -> Scheduler:
    """A scheduler over requests that exercise the wire: a few long prompts (tables wider
    than 16 blocks), prompt logprobs on some, short outputs so some finish early."""
    rng = random.Random(seed)
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
    config = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=128, max_model_len=128)
    scheduler = Scheduler(config, kv, eos_token_ids=[])
    for i in range(num_requests):
        prompt_len = 70 if i in (num_requests - 3, num_requests - 1) else rng.randrange(2, 9)
        params = SamplingParams(
            max_tokens=rng.randrange(2, 8),
            ignore_eos=True,
            prompt_logprobs=1 if i % 4 == 1 else None,
        )
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        scheduler.add(Sequence(f"r{i}", prompt, params, block_size=BS))
    return scheduler


def greedy(out: SchedulerOutput, logits: torch.Tensor) -> dict[str, int]:
    sampling = [item.seq.request_id for item in out.scheduled if item.will_sample]
    return dict(zip(sampling, logits[:, :VOCAB].argmax(dim=1).tolist(), strict=True))


def assert_batches_equal(got: HostBatch, want: HostBatch) -> None:
    def same(a: np.ndarray | None, b: np.ndarray | None) -> None:
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)

    same(got.input_ids, want.input_ids)
    for field in dataclasses.fields(want.layout):
        a, b = getattr(got.layout, field.name), getattr(want.layout, field.name)
        if isinstance(b, np.ndarray):
            same(a, b)
        else:
            assert a == b, field.name
    same(got.table.rows, want.table.rows)
    same(got.table.index, want.table.index)
    same(got.table.values, want.table.values)
    assert got.table.width == want.table.width
    same(got.sample_rows, want.sample_rows)
    same(got.prompt_rows, want.prompt_rows)
    assert got.table_shape == want.table_shape


def test_every_field_round_trips_through_a_scheduled_run() -> None:
    scheduler = busy_scheduler(20)
    runner = tiny_runner(None)
    seen_prompt_rows = seen_released = seen_partial_sample = seen_writes = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        runner.release(out.finished_request_ids)
        batch = runner.prepare(out.scheduled)
        step = decode_step(encode_step(batch, out.finished_request_ids))
        assert step is not None
        assert_batches_equal(step.batch, batch)
        assert step.released == out.finished_request_ids
        seen_prompt_rows |= batch.prompt_rows is not None
        seen_released |= bool(out.finished_request_ids)
        seen_partial_sample |= batch.sample_rows is not None
        seen_writes |= batch.table.num_writes > 0
        scheduler.update(
            out, runner_output({s.seq.request_id: 1 for s in out.scheduled if s.will_sample})
        )
    assert seen_prompt_rows
    assert seen_released
    assert seen_partial_sample
    assert seen_writes
    # More live sequences than the first 16 rows, and tables past the first 16 columns.
    assert runner.block_table.host.shape[0] > 16
    assert runner.block_table.num_cols > 16


def test_an_empty_batch_round_trips() -> None:
    batch = tiny_runner(None).prepare([])
    step = decode_step(encode_step(batch, ["gone"]))
    assert step is not None
    assert step.batch.input_ids.shape == (0,)
    assert step.batch.table.num_writes == 0
    assert_batches_equal(step.batch, batch)
    assert step.released == ["gone"]


def test_the_stop_message_decodes_to_none() -> None:
    assert decode_step(encode_stop()) is None


def test_malformed_steps_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_step(msgspec.msgpack.encode([False, "not an array"]))
    short = WireArray("int64", 3, b"\0" * 16)  # 16 bytes cannot hold 3 int64
    with pytest.raises(ValueError, match="do not hold"):
        decode_step(msgspec.msgpack.encode(StepMessage(query_start_loc=short)))
    # A step that is not a stop must carry every array.
    with pytest.raises(ValueError, match="lacks"):
        decode_step(msgspec.msgpack.encode(StepMessage()))


def test_a_received_batch_runs_exactly_like_a_local_step() -> None:
    """Runner `local` runs `execute(scheduled)`; `leader` only prepares and encodes; the
    `follower` runs what it decodes, in its own KV cache and block table, growing that
    table only from the messages. Logits and prompt hidden states are bitwise equal."""
    model = tiny_model()
    local, leader, follower = tiny_runner(model), tiny_runner(None), tiny_runner(model)
    scheduler = busy_scheduler(20, seed=1)
    num_steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        local.release(out.finished_request_ids)
        leader.release(out.finished_request_ids)
        want = local.execute(out.scheduled)
        step = decode_step(encode_step(leader.prepare(out.scheduled), out.finished_request_ids))
        assert step is not None
        follower.release(step.released)
        got = follower.execute_host(step.batch)
        assert torch.equal(got.logits, want.logits)
        assert (got.prompt_hidden is None) == (want.prompt_hidden is None)
        if want.prompt_hidden is not None:
            assert got.prompt_hidden is not None
            assert torch.equal(got.prompt_hidden, want.prompt_hidden)
        scheduler.update(out, runner_output(greedy(out, want.logits)))
        num_steps += 1
    assert num_steps > 5
    assert follower.block_table.device_table.shape == local.block_table.device_table.shape
    assert torch.equal(follower.block_table.device_table, local.block_table.device_table)


def test_a_world_of_one_leads_without_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> bytes:
        raise AssertionError("a world of 1 encodes nothing")

    monkeypatch.setattr(step_module, "encode_step", refuse)
    monkeypatch.setattr(step_module, "encode_stop", refuse)
    model = tiny_model()
    local, alone = tiny_runner(model), tiny_runner(model)
    group = TPGroup.single(torch.device("cpu"))
    scheduler = busy_scheduler(4, seed=3)
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        local.release(out.finished_request_ids)
        want = local.execute(out.scheduled)
        got = lead_step(alone, group, out.scheduled, out.finished_request_ids)
        assert torch.equal(got.logits, want.logits)
        scheduler.update(out, runner_output(greedy(out, want.logits)))
    stop_followers(group)
    with pytest.raises(ValueError, match="only the other ranks follow"):
        follower_loop(alone, group)
