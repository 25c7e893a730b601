"""Start-up autotuning: the bucketed keys, the shapes `tune` runs, and that together they reach
every key a server can launch with (so no request ever autotunes)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton

from gpu_worker.attention.backend import attention_variants
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from kernels import paged_attention, prefill_attention
from kernels.paged_attention import (
    DECODE_TUNE_KEY,
    DECODE_UNSPECIALIZED,
    batch_bucket,
    choose_split_size,
    decode_context,
    paged_decode_attention,
)
from kernels.prefill_attention import (
    PREFILL_TUNE_KEY,
    PREFILL_UNSPECIALIZED,
    choose_block_m,
    paged_prefill_attention,
    tokens_bucket,
)
from kernels.tuning import decode_tune_shapes, powers_of_two, prefill_tune_shapes
from tests.helpers.kernel_checks import KernelRecorder


@dataclass(frozen=True)
class _Config:
    """The fields `tune` reads of a ModelConfig."""

    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    attn_logit_softcapping: float | None = None
    layer_windows: tuple[int | None, ...] = (None, None, None, None)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer]


def test_keys_are_buckets_never_raw_lengths() -> None:
    assert "num_splits" not in DECODE_TUNE_KEY
    assert {"split_size", "batch_bucket", "SOFTCAP", "HAS_WINDOW"} <= set(DECODE_TUNE_KEY)
    assert {"tokens_bucket", "BLOCK_M", "SOFTCAP", "HAS_WINDOW"} <= set(PREFILL_TUNE_KEY)
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert [tokens_bucket(n) for n in (1, 16, 17, 40, 8192)] == [16, 16, 32, 64, 8192]
    assert powers_of_two(40) == [1, 2, 4, 8, 16, 32, 64]
    assert powers_of_two(16, start=16) == [16]


def test_variants_are_each_window_and_cap_the_layers_use() -> None:
    assert attention_variants(_Config()) == [(None, None)]
    gemma2 = _Config(attn_logit_softcapping=50.0, layer_windows=(4096, None, 4096, None))
    assert attention_variants(gemma2) == [(None, 50.0), (4096, 50.0)]


LIMITS = dict(page_size=16, num_kv_heads=2, num_programs_target=4 * 132)


@pytest.mark.parametrize("window", [None, 1000])
def test_decode_shapes_reach_every_launchable_key(window: int | None) -> None:
    """Every (batch, block-table width) a server with these limits can launch, eager or in
    a CUDA graph, has its autotune key among the tuned shapes'."""
    max_num_seqs, max_model_len, cache_tokens = 40, 4000, 50_000
    shapes = decode_tune_shapes(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        cache_tokens=cache_tokens,
        window=window,
        **LIMITS,
    )

    def key(num_seqs: int, num_blocks: int) -> tuple[int, int, bool]:
        tables = torch.empty(num_seqs, num_blocks)
        context = decode_context(tables, LIMITS["page_size"], window)
        split = choose_split_size(
            num_seqs, LIMITS["num_kv_heads"], context, LIMITS["num_programs_target"]
        )
        return batch_bucket(num_seqs), split, triton.cdiv(context, split) == 1

    tuned = {key(s.num_seqs, s.num_blocks) for s in shapes}
    max_blocks = triton.cdiv(max_model_len, LIMITS["page_size"])
    launchable = {
        key(n, width) for n in range(1, max_num_seqs + 1) for width in range(1, max_blocks + 1)
    }
    assert launchable == tuned
    assert len(shapes) == len(tuned)  # one launch per key, no more
    for s in shapes:
        assert s.num_blocks <= max_blocks
        assert s.num_seqs <= max_num_seqs
        assert 1 <= s.seq_len <= s.num_blocks * LIMITS["page_size"]
        assert s.seq_len * s.num_seqs <= cache_tokens  # the rows fit in the cache at once


@pytest.mark.parametrize("group_pad", [1, 4, 8])
def test_prefill_shapes_reach_every_launchable_key(group_pad: int) -> None:
    """Every (step tokens, longest query) a step of at most max_num_batched_tokens can have."""
    max_tokens = 300
    shapes = prefill_tune_shapes(max_num_batched_tokens=max_tokens, group_pad=group_pad)
    tuned = {
        (tokens_bucket(sum(s.query_lens())), choose_block_m(max(s.query_lens()), group_pad))
        for s in shapes
    }
    launchable = {
        (tokens_bucket(tokens), choose_block_m(query_len, group_pad))
        for tokens in range(1, max_tokens + 1)
        for query_len in range(1, tokens + 1)
    }
    assert launchable == tuned
    assert len(shapes) == len(tuned)
    assert all(sum(s.query_lens()) <= max_tokens for s in shapes)


def test_tune_is_nothing_off_the_gpu() -> None:
    """The torch backend has nothing to tune; the Triton one has no autotuner under the
    interpreter or on CPU tensors, and launches nothing there."""
    cache = torch.zeros(2, 4, 16, 2, 64)
    limits = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    TorchAttentionBackend().tune(_Config(), cache, **limits)
    backend = TritonAttentionBackend()

    def no_launch(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("tune launched a kernel off the GPU")

    backend._decode = backend._prefill = no_launch
    backend.tune(_Config(), cache, **limits)


def test_tuning_launches_are_valid_kernel_launches(device: torch.device) -> None:
    """What `tune` launches on a GPU, run here through the interpreter on a small cache: one
    launch per decode and prefill shape of each variant (a window and a cap: two), and
    every one a launch the kernels accept."""
    gemma2 = _Config(attn_logit_softcapping=50.0, layer_windows=(24, None, 24, None))
    cache = torch.zeros(2, 6, 16, 2, 16, device=device)
    limits = dict(max_num_seqs=3, max_num_batched_tokens=40, max_model_len=64)
    launches = TritonAttentionBackend().launch_tuning_shapes(
        gemma2, cache, **limits, num_programs_target=8
    )
    expected = 0
    for window, _ in attention_variants(gemma2):
        expected += len(
            decode_tune_shapes(
                max_num_seqs=3,
                max_model_len=64,
                page_size=16,
                num_kv_heads=2,
                cache_tokens=6 * 16,
                num_programs_target=8,
                window=window,
            )
        )
        expected += len(prefill_tune_shapes(max_num_batched_tokens=40, group_pad=4))
    assert launches == expected


def test_ints_that_vary_between_steps_are_not_specialized(monkeypatch, make_paged_batch):
    """Launch both kernels on steps of different sizes and contexts: every int argument that
    differs between them is one Triton does not specialize on (else a step could hit an
    uncompiled variant after start-up tuning and compile on a request)."""
    decode, prefill = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(paged_attention, "_paged_decode_kernel", decode)
    monkeypatch.setattr(paged_attention, "_combine_splits_kernel", KernelRecorder())
    monkeypatch.setattr(prefill_attention, "_paged_prefill_kernel", prefill)
    for query_lens, context_lens, window in (([1], [0], None), ([1] * 5, [300] * 5, 9)):
        for decodes in (True, False):
            lens = query_lens if decodes else [n + 16 for n in query_lens]
            kv_cache, meta = make_paged_batch(lens, context_lens, 2, 16, torch.float32)
            q = torch.zeros(sum(lens), 4, 16, device=kv_cache.device)
            if decodes:
                paged_decode_attention(
                    q, kv_cache, meta.block_tables, meta.seq_lens, 1.0, window=window
                )
            else:
                args = (meta.block_tables, meta.query_start_loc, meta.seq_lens)
                paged_prefill_attention(
                    q, kv_cache, *args, meta.context_lens, meta.max_query_len, 1.0, window=window
                )
    for recorder, kernel, unspecialized in (
        (decode, paged_attention._paged_decode_kernel_tuned, DECODE_UNSPECIALIZED),
        (prefill, prefill_attention._paged_prefill_kernel_tuned, PREFILL_UNSPECIALIZED),
    ):
        (_, first), (_, second) = recorder.launches
        varying = {
            name
            for name, a, b in zip(kernel.arg_names, first, second, strict=False)
            if isinstance(a, int) and a != b
        }
        assert varying
        assert varying <= set(unspecialized)
