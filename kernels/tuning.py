"""The shapes the attention autotuners are run over at start-up, one per autotune key.

Triton's autotuner benchmarks every config the first time it meets a new key, then caches the
winner for the process. The kernels key on buckets (powers of two of the batch, of the split
size, of the step's token count; the tile height), never on raw lengths, so a start-up sweep
can meet every key a server will ever launch with: `decode_tune_shapes` and
`prefill_tune_shapes` list one representative shape per key, computed with the same functions
the launchers use. The attention backend's `tune` runs them (gpu_worker/attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from kernels.paged_attention import batch_bucket, choose_split_size
from kernels.prefill_attention import MIN_TOKENS_BUCKET, choose_block_m, tokens_bucket


@dataclass(frozen=True)
class DecodeShape:
    """A decode launch: `num_seqs` rows, block tables `num_blocks` wide, every row
    `seq_len` keys long (as long as the KV cache can hold for all rows at once)."""

    num_seqs: int
    num_blocks: int
    seq_len: int


@dataclass(frozen=True)
class PrefillShape:
    """A prefill launch of `num_tokens` new tokens in chunks of `query_len` (the last one
    shorter when it does not divide), no cached prefix."""

    num_tokens: int
    query_len: int

    def query_lens(self) -> list[int]:
        full, rest = divmod(self.num_tokens, self.query_len)
        return [self.query_len] * full + ([rest] if rest else [])


def powers_of_two(limit: int, start: int = 1) -> list[int]:
    """start, 2 * start, ... up to the first power of two >= limit."""
    values = [start]
    while values[-1] < limit:
        values.append(values[-1] * 2)
    return values


def decode_tune_shapes(
    *,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    num_kv_heads: int,
    cache_tokens: int,
    num_programs_target: int,
    window: int | None = None,
) -> list[DecodeShape]:
    """One shape per decode autotune key (batch bucket, split size, single split or not) a
    server with these limits can launch, decode steps of any batch and context up to
    `max_model_len` (CUDA graphs launch with the full-width block table, eager steps with the
    batch's own); per key the longest context, the most work a key's config must serve."""
    shapes: dict[tuple[int, int, bool], DecodeShape] = {}
    for batch in powers_of_two(max_num_seqs):
        num_seqs = min(batch, max_num_seqs)
        for tokens in powers_of_two(max_model_len, page_size):
            num_blocks = triton.cdiv(min(tokens, max_model_len), page_size)
            context = num_blocks * page_size
            if window is not None:
                context = min(context, window)
            split_size = choose_split_size(num_seqs, num_kv_heads, context, num_programs_target)
            single = triton.cdiv(context, split_size) == 1
            seq_len = max(1, min(num_blocks * page_size, cache_tokens // num_seqs))
            key = (batch_bucket(num_seqs), split_size, single)
            shapes[key] = DecodeShape(num_seqs, num_blocks, seq_len)
    return list(shapes.values())


def prefill_tune_shapes(*, max_num_batched_tokens: int, group_pad: int) -> list[PrefillShape]:
    """One shape per prefill autotune key (token bucket, tile height) a step of at most
    `max_num_batched_tokens` tokens can launch with; per key the longest chunks (the tile
    height follows the step's longest query)."""
    shapes: dict[tuple[int, int], PrefillShape] = {}
    for total in powers_of_two(max_num_batched_tokens, MIN_TOKENS_BUCKET):
        num_tokens = min(total, max_num_batched_tokens)
        for query_len in powers_of_two(num_tokens):
            query_len = min(query_len, num_tokens)
            key = (tokens_bucket(num_tokens), choose_block_m(query_len, group_pad))
            shapes[key] = PrefillShape(num_tokens, query_len)
    return list(shapes.values())
