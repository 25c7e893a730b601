"""Decode CUDA graphs: buckets, padding rows, and the engine's outputs with graphs on.

Here (no GPU) the graph runner runs with `capture=False`: the same static buffers, padding
and slicing, with the Triton kernels in the interpreter, so everything but the capture itself
is checked. The `cuda` tests capture for real on SmolLM2 and compare with eager runs.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker import Completion, Engine
from gpu_worker.attention.metadata import BatchLayout, build_attention_metadata, layout_batch
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.core.sequence import Sequence
from gpu_worker.loader import load_model
from gpu_worker.runner.block_table import BlockTable, BlockTableStep
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner, batch_size_buckets
from gpu_worker.runner.kv_caches import allocate_kv_caches
from shared.model_source import resolve_model
from shared.protocol import TokenLogprobs
from shared.sampling import SamplingParams
from tests.helpers.kernel_checks import interpreter_only

BLOCK_SIZE = 16


def test_buckets_cover_every_batch_size_with_little_padding() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(6) == [1, 2, 4, 6]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = batch_size_buckets(256)
    assert buckets[:5] == [1, 2, 4, 8, 16]
    assert buckets[-1] == 256
    for n in range(1, 257):
        bucket = min(b for b in buckets if b >= n)
        assert bucket - n < 8
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        batch_size_buckets(0)


def _model_and_caches(
    model_dir: Path, num_blocks: int
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    source = resolve_model(str(model_dir))
    model, config = load_model(source, torch.device("cpu"), torch.float32, TritonAttentionBackend())
    caches = allocate_kv_caches(
        config.num_layers,
        num_blocks,
        BLOCK_SIZE,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        "cpu",
    )
    return model, caches


def _runner(
    model: torch.nn.Module,
    caches: list[torch.Tensor],
    block_table: BlockTable,
    max_batch_size: int,
    max_blocks_per_seq: int,
    capture: bool = False,
) -> DecodeGraphRunner:
    return DecodeGraphRunner(
        model,
        model.attn_backend,
        caches,
        block_table,
        max_batch_size=max_batch_size,
        max_blocks_per_seq=max_blocks_per_seq,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
        capture=capture,
    )


def _decode_step(
    table: BlockTable, block_tables: list[list[int]], context_lens: list[int], tag: str
) -> tuple[BatchLayout, BlockTableStep]:
    """A decode step of sequences `{tag}{i}` holding these blocks, as the runner lays it out."""
    seqs = []
    for i, blocks in enumerate(block_tables):
        seq = Sequence(f"{tag}{i}", [1], SamplingParams(), block_size=BLOCK_SIZE)
        seq.block_table = blocks
        seqs.append(seq)
    step = table.update(seqs)
    ones = np.ones(len(seqs), dtype=np.int64)
    layout = layout_batch(ones, np.asarray(context_lens), table.host, BLOCK_SIZE, step.rows)
    return layout, step


@interpreter_only
def test_padding_rows_leave_the_cache_alone_and_match_eager(tiny_llama_dir: Path) -> None:
    model, caches = _model_and_caches(tiny_llama_dir, num_blocks=12)
    for cache in caches:
        cache.normal_()
    eager_caches = [c.clone() for c in caches]
    table = BlockTable(torch.device("cpu"), num_rows=4, num_cols=2)
    runner = _runner(model, caches, table, 8, 4)
    runner.capture_all()
    # Every per-row input is a view of the one buffer the step's single copy fills.
    storage = runner.staged.device_buffer.untyped_storage().data_ptr()
    for static in (runner.input_ids, runner.positions, runner.slot_mapping, runner.seq_lens):
        assert static.untyped_storage().data_ptr() == storage
    # A step of 5 rows first leaves stale rows 3..4 behind in the static buffers.
    first, first_table = _decode_step(table, [[9]] * 5, [1, 2, 3, 4, 5], "old")
    first.slot_mapping.fill(-1)  # write nothing, only occupy the buffers
    runner.run(np.arange(5), first, first_table)
    table.release([f"old{i}" for i in range(5)])
    before = [c.clone() for c in caches]

    tables = [[3, 7], [1], [10, 2, 5]]
    context_lens = [20, 9, 40]
    layout, step = _decode_step(table, tables, context_lens, "new")
    assert runner.bucket_for(3) == 4
    assert runner.can_run(layout, step)
    ids = np.array([5, 17, 200])
    hidden = runner.run(ids, layout, step)
    eager_meta = build_attention_metadata([1, 1, 1], context_lens, tables, BLOCK_SIZE)
    model.attn_backend.plan(eager_meta, eager_caches[0])
    with torch.inference_mode():
        expected = model(
            torch.from_numpy(ids), torch.tensor(context_lens), eager_meta, eager_caches
        )
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    # The static tables hold the sequences' blocks; the padding row gathered the null row.
    for row, blocks in enumerate(tables):
        assert runner.block_tables[row, : len(blocks)].tolist() == blocks
    assert runner.block_tables[3].tolist() == [0] * 4
    assert runner.slot_mapping[3].item() == -1
    assert runner.seq_lens[3].item() == 0
    # Only the three new tokens' slots changed, in every layer, exactly as the eager run did.
    written = eager_meta.slot_mapping.tolist()
    assert layout.slot_mapping.tolist() == written
    for cache, old, eager in zip(caches, before, eager_caches, strict=True):
        changed = (cache != old).flatten(1, 2).any(-1).any(-1).any(0).nonzero().flatten()
        assert sorted(changed.tolist()) == sorted(written)
        torch.testing.assert_close(cache.flatten(1, 2)[:, written], eager.flatten(1, 2)[:, written])


@interpreter_only
def test_steps_too_big_or_not_pure_decode_run_eagerly(tiny_llama_dir: Path) -> None:
    model, caches = _model_and_caches(tiny_llama_dir, num_blocks=64)
    table = BlockTable(torch.device("cpu"))
    runner = _runner(model, caches, table, 2, 2)
    assert runner.can_run(*_decode_step(table, [[0]] * 2, [1, 1], "a"))
    assert not runner.can_run(*_decode_step(table, [[0]] * 3, [1, 1, 1], "b"))
    assert not runner.can_run(*_decode_step(table, [[0, 1, 2]], [40], "c"))  # too wide
    prefill, prefill_table = _decode_step(table, [[0]], [0], "d")
    prefill = layout_batch(np.array([4]), np.array([0]), table.host, BLOCK_SIZE, prefill_table.rows)
    assert not runner.can_run(prefill, prefill_table)
    # More table writes than a graph step carries (8 here) run eagerly.
    wide = _runner(model, caches, table, 2, 16)
    assert not wide.can_run(*_decode_step(table, [list(range(9))], [130], "e"))
    assert wide.can_run(*_decode_step(table, [list(range(8))], [120], "f"))
    with pytest.raises(ValueError, match="no decode graph fits"):
        runner.run(np.zeros(3, dtype=np.int64), *_decode_step(table, [[0]] * 3, [1] * 3, "g"))
    with pytest.raises(ValueError, match="CUDA"):
        _runner(model, caches, table, 2, 2, capture=True)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


@interpreter_only
def test_engine_outputs_equal_with_the_graph_path(tiny_llama_dir: Path) -> None:
    """Six requests of different lengths: the batch shrinks through buckets 8, 4, 2 and 1 as
    they finish, every step of it through the static buffers; tokens equal the eager run."""
    engine = Engine(
        model=str(tiny_llama_dir),
        device="cpu",
        attention_backend="triton",
        max_model_len=96,
        kv_cache_memory_gb=0.01,
    )
    prompts = _prompts(6, engine.vocab_size)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 9, 2, 12, 7)
    ]
    eager = engine.generate(prompts, params)
    assert engine.runner.decode_graphs is None  # CPU: no graphs unless asked for
    engine.reset_prefix_cache()
    graphs = _runner(
        engine.model, engine.runner.kv_caches, engine.runner.block_table, 8, 96 // BLOCK_SIZE
    )
    graphs.capture_all()
    engine.runner.decode_graphs = graphs
    with_graphs = engine.generate(prompts, params)
    assert engine.runner.num_graph_steps >= 11  # the longest request decodes 11 times
    assert [c.token_ids for c in with_graphs] == [c.token_ids for c in eager]
    assert [len(c.token_ids) for c in with_graphs] == [3, 5, 9, 2, 12, 7]


CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to juggle.",
    "What does a compiler do?",
]


def _chat_prompts() -> list[list[int]]:
    from render_server.templating.chat_template import ChatRenderer
    from render_server.templating.tokenizer import Tokenizer

    source = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = Tokenizer.from_source(source)
    renderer = ChatRenderer(tokenizer)
    return [
        renderer.render([{"role": "user", "content": text}], add_generation_prompt=True).token_ids
        for text in CHAT
    ]


@pytest.mark.cuda
def test_cuda_graphs_equal_eager_on_smollm2(cuda_device: torch.device) -> None:
    prompts = _chat_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        engine = Engine(device="cuda", enforce_eager=eager, max_num_seqs=16)
        assert (engine.runner.decode_graphs is None) is eager
        outputs[eager] = [c.token_ids for c in engine.generate(prompts, params)]
        if not eager:
            assert engine.runner.num_graph_steps > 0
        del engine
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]


@pytest.mark.cuda
def test_verify_steps_replay_decode_graphs_and_keep_greedy_output(
    cuda_device: torch.device,
) -> None:
    # A verify step is a decode step of 1 + k rows per sequence: the graphs cover it.
    prompts = _chat_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    speculative = '{"method": "ngram", "num_speculative_tokens": 3, "draft_length": "fixed"}'
    outputs = {}
    for config in (None, speculative):
        engine = Engine(device="cuda", max_num_seqs=8, speculative_config=config)
        graphs = engine.runner.decode_graphs
        assert graphs is not None
        assert graphs.bucket_for(8 * 4) is not None
        outputs[config] = [c.token_ids for c in engine.generate(prompts, params)]
        if config is not None:
            stats = engine.stats()
            assert stats.spec_num_accepted_tokens > 0
            # Fewer steps than tokens, and the decode steps (verify ones among them) replay.
            assert engine.runner.num_graph_steps > 0
            assert stats.steps < sum(map(len, outputs[config]))
        del engine
        torch.cuda.empty_cache()
    assert outputs[speculative] == outputs[None]


# bf16 logits of two attention paths (summation orders) differ by a few hundredths of a nat.
BF16_LOGPROB_TOL = 0.15


def check_greedy_parity(ours: Completion, reference: Completion, tol: float) -> None:
    """Greedy outputs of two numerical paths agree up to where the reference itself was
    undecided: the paths' logprobs of each shared token agree within `tol`, and at the first
    token that differs, our token was within `tol` of the reference's top choice there (a
    near-tie that rounding may flip). What follows a flip is a different text, not compared."""
    assert ours.logprobs is not None
    assert reference.logprobs is not None
    for ours_token, ref_token, ours_lp, ref_lp in zip(
        ours.token_ids, reference.token_ids, ours.logprobs, reference.logprobs, strict=True
    ):
        if ours_token == ref_token:
            assert abs(ours_lp.logprob - ref_lp.logprob) <= tol, (ours_token, ours_lp, ref_lp)
            continue
        ranked = dict(zip(ref_lp.top_token_ids, ref_lp.top_logprobs, strict=True))
        assert ours_token in ranked, f"{ours_token} is outside the reference's top {len(ranked)}"
        margin = ref_lp.logprob - ranked[ours_token]
        assert margin <= tol, f"not a near-tie: {ours_token} was {margin:.3f} nats behind"
        return


def _completion(tokens: list[int], logprobs: list[tuple[float, dict[int, float]]]) -> Completion:
    return Completion(
        tokens,
        "length",
        [TokenLogprobs(lp, 1, list(top), list(top.values())) for lp, top in logprobs],
        0,
    )


def test_greedy_parity_allows_a_flip_only_at_a_near_tie() -> None:
    reference = _completion(
        [7, 7, 3], [(-0.5, {7: -0.5, 9: -0.55}), (-0.1, {7: -0.1}), (-1, {3: -1})]
    )
    check_greedy_parity(reference, reference, 0.15)
    flipped = _completion([7, 9, 9], [(-0.52, {7: -0.52}), (-2.0, {9: -2.0}), (-3, {9: -3})])
    with pytest.raises(AssertionError, match="outside the reference's top"):
        check_greedy_parity(flipped, reference, 0.15)
    near_tie = _completion([9, 1, 1], [(-0.55, {9: -0.55, 7: -0.5}), (-1, {1: -1}), (-1, {1: -1})])
    check_greedy_parity(near_tie, reference, 0.15)
    with pytest.raises(AssertionError, match="not a near-tie"):
        check_greedy_parity(near_tie, reference, 0.01)
    drifted = _completion([7, 7, 3], [(-0.9, {7: -0.9}), (-0.1, {7: -0.1}), (-1, {3: -1})])
    with pytest.raises(AssertionError):
        check_greedy_parity(drifted, reference, 0.15)


@pytest.mark.cuda
def test_triton_backend_greedy_parity_with_torch_backend(cuda_device: torch.device) -> None:
    """Both backends in bf16 on the GPU over a batch of chat prompts: the same greedy tokens
    and logprobs, except where a near-tie flips once the summation order differs (on the
    device check's random-weight stand-in the first token can be one: seen on the H200)."""
    prompts = _chat_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine(device="cuda", attention_backend=backend, enforce_eager=True)
        outputs[backend] = engine.generate(prompts, params)
        del engine
        torch.cuda.empty_cache()
    for ours, reference in zip(outputs["triton"], outputs["torch"], strict=True):
        check_greedy_parity(ours, reference, BF16_LOGPROB_TOL)


@pytest.mark.cuda
def test_async_scheduling_equals_in_order_steps_with_graphs(cuda_device: torch.device) -> None:
    # The unresolved decode inputs are written into the graphs' static input ids on the
    # device; greedy, seeded and logprob outputs must not change.
    prompts = _chat_prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
    ] * (len(prompts) // 2) + [SamplingParams(temperature=0.0, max_tokens=8)] * (len(prompts) % 2)
    outputs = {}
    for async_on in (False, True):
        engine = Engine(device="cuda", max_num_seqs=16, async_scheduling=async_on)
        assert engine.async_scheduling is async_on
        done = engine.generate(prompts, params)
        outputs[async_on] = [(c.token_ids, c.logprobs) for c in done]
        assert engine.runner.num_graph_steps > 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        del engine
        torch.cuda.empty_cache()
    assert [t for t, _ in outputs[True]] == [t for t, _ in outputs[False]]
    for (_, lp_on), (_, lp_off) in zip(outputs[True], outputs[False], strict=True):
        if lp_off is None:
            assert lp_on is None
            continue
        assert lp_on is not None
        assert [e.top_token_ids for e in lp_on] == [e.top_token_ids for e in lp_off]
        assert [e.logprob for e in lp_on] == pytest.approx([e.logprob for e in lp_off], abs=1e-4)
