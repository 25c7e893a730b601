"""Both attention kernels on skewed batches, one long sequence among short ones (the case
split-K by a fixed token count is for), against their torch references; and the decode grid
a 16k-token sequence gets in a batch of 64."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention
from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.helpers.kernel_checks import ATTENTION_TOL, KernelRecorder, random_tensor

# group (= num_heads // num_kv_heads), num_kv_heads, head_dim: GQA 1/4/8, head dims 64/128,
# few heads so the interpreter runs a 3k-token sequence in seconds.
GQA_CASES = [
    pytest.param(1, 2, 128, id="mha-d128"),
    pytest.param(4, 2, 64, id="gqa4-d64"),
    pytest.param(8, 1, 128, id="gqa8-d128"),
]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("group", "num_kv_heads", "head_dim"), GQA_CASES)
def test_decode_one_long_sequence_among_short_ones(
    make_paged_batch, device, group, num_kv_heads, head_dim
):
    seq_lens = [5, 3000, 1, 130, 17]
    kv_cache, meta = make_paged_batch(
        [1] * len(seq_lens), [n - 1 for n in seq_lens], num_kv_heads, head_dim, torch.float32
    )
    q = random_tensor(len(seq_lens), num_kv_heads * group, head_dim, dtype=torch.float32,
                      device=device)  # fmt: skip
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, head_dim**-0.5)
    # The launcher's own split size: 1024 here, so 3 splits, two of them empty for all but
    # the long sequence.
    _close(paged_decode_attention(*args), paged_decode_attention_ref(*args))


@pytest.mark.parametrize(("group", "num_kv_heads", "head_dim"), GQA_CASES[:2])
def test_prefill_one_long_chunk_among_short_ones(
    make_paged_batch, device, group, num_kv_heads, head_dim
):
    """A 150-token chunk over a 1.5k-token prefix beside decodes and a short fresh prompt."""
    query_lens, context_lens = [1, 150, 7, 1], [40, 1500, 0, 3]
    kv_cache, meta = make_paged_batch(query_lens, context_lens, num_kv_heads, head_dim,
                                      torch.float32)  # fmt: skip
    q = random_tensor(sum(query_lens), num_kv_heads * group, head_dim, dtype=torch.float32,
                      device=device)  # fmt: skip
    lengths = (meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.context_lens)
    out = paged_prefill_attention(q, kv_cache, *lengths, meta.max_query_len, head_dim**-0.5)
    _close(out, paged_prefill_attention_ref(q, kv_cache, *lengths, head_dim**-0.5))


def test_a_16k_sequence_among_63_short_ones_is_spread(monkeypatch, device):
    """Batch 64, block tables 16k tokens wide: the long sequence gets 16 programs per KV
    head of 1024 tokens each (the old heuristic gave it one of 16k: the step's tail), and
    the grid is the same whatever the lengths are (a CUDA graph replays it)."""
    decode, combine = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(paged_attention, "_paged_decode_kernel", decode)
    monkeypatch.setattr(paged_attention, "_combine_splits_kernel", combine)
    num_seqs, num_kv_heads, head_dim, page = 64, 8, 128, 16
    kv_cache = torch.zeros(2, 4, page, num_kv_heads, head_dim, device=device)
    tables = torch.zeros(num_seqs, 16384 // page, dtype=torch.int32, device=device)
    q = torch.zeros(num_seqs, 4 * num_kv_heads, head_dim, device=device)
    for long_len in (16384, 200):
        seq_lens = torch.full((num_seqs,), 100, dtype=torch.int32, device=device)
        seq_lens[7] = long_len
        paged_decode_attention(q, kv_cache, tables, seq_lens, 0.1)
    grids = {grid for grid, _ in decode.launches}
    assert grids == {(num_seqs, num_kv_heads, 16)}
    split_size = decode.launches[0][1][19]  # the kernel's split_size argument
    assert split_size == 1024
    assert {grid for grid, _ in combine.launches} == {(num_seqs, 4 * num_kv_heads)}


def test_decode_16k_sequence_among_short_ones(make_paged_batch, device):
    """The 16k case itself through the kernel, one KV head (seconds interpreted)."""
    seq_lens = [16384, 3, 40, 1, 700, 16]
    kv_cache, meta = make_paged_batch([1] * 6, [n - 1 for n in seq_lens], 1, 64, torch.float32)
    q = random_tensor(6, 4, 64, dtype=torch.float32, device=device)
    args = (q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    _close(paged_decode_attention(*args), paged_decode_attention_ref(*args))
