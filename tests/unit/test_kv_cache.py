"""KVCacheManager: exact block ids, ref counts, prefix hits, eviction order and the KV
cache events that describe the cached hashes."""

from __future__ import annotations

import random

import pytest

from gpu_worker.core.config import CacheConfig
from gpu_worker.core.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVCacheManager,
)
from gpu_worker.core.sequence import Sequence
from shared.hashing import prefix_block_hashes
from shared.sampling import SamplingParams

BS = 16


def make_kv(num_blocks: int = 8, prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix)
    )


def make_seq(request_id: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), cache_salt=salt, block_size=BS)


def compute(kv: KVCacheManager, seq: Sequence, cached: list[int] | None = None) -> None:
    """Admit `seq` and pretend the model computed all its known tokens in one step."""
    cached = cached or []
    num_cached = len(cached) * BS
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [block.ref_count for block in kv.pool.blocks]


def test_allocation_hands_out_blocks_in_order() -> None:
    kv = make_kv()
    a, b = make_seq("a", list(range(20))), make_seq("b", list(range(5)))
    assert kv.allocate_slots(a, 20)
    assert kv.allocate_slots(b, 5)
    assert a.block_table == [0, 1]
    assert b.block_table == [2]
    assert ref_counts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_growing_within_a_block_takes_no_new_block() -> None:
    kv = make_kv()
    seq = make_seq("a", list(range(17)))
    assert kv.allocate_slots(seq, 17)
    seq.num_computed_tokens = 17
    assert kv.allocate_slots(seq, 15)  # up to 32 tokens: still two blocks
    assert seq.block_table == [0, 1]
    assert kv.allocate_slots(seq, 16)
    assert seq.block_table == [0, 1, 2]


def test_unhashed_blocks_return_to_the_front_in_table_order() -> None:
    kv = make_kv()
    a, b = make_seq("a", list(range(20))), make_seq("b", list(range(5)))
    kv.allocate_slots(a, 20)
    kv.allocate_slots(b, 5)
    kv.free(a)  # never computed, so nothing hashed: reuse these before anything else
    assert kv.pool.free_block_ids == [0, 1, 3, 4, 5, 6, 7]
    assert a.block_table == []
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert ref_counts(kv) == [0] * 8


def test_allocation_fails_without_side_effects() -> None:
    kv = make_kv(num_blocks=2)
    a = make_seq("a", list(range(40)))
    assert not kv.allocate_slots(a, 40)  # needs three blocks
    assert a.block_table == []
    assert kv.num_free_blocks == 2
    assert kv.stats.queries == 0


def test_prefix_hit_of_three_shared_blocks() -> None:
    kv = make_kv()
    shared = list(range(100, 148))  # exactly three blocks
    a = make_seq("a", shared + [1, 2])
    compute(kv, a)
    assert a.block_table == [0, 1, 2, 3]

    b = make_seq("b", shared + [7, 8, 9, 10])
    cached, num_cached = kv.get_computed_blocks(b)
    assert (cached, num_cached) == ([0, 1, 2], 48)
    assert kv.allocate_slots(b, b.num_tokens - num_cached, cached)
    assert b.block_table == [0, 1, 2, 4]
    assert ref_counts(kv)[:5] == [2, 2, 2, 1, 1]
    assert kv.stats.queries == 50 + 52
    assert kv.stats.hits == 48
    assert kv.hit_rate == pytest.approx(48 / 102)

    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_last_token_is_never_served_from_cache() -> None:
    kv = make_kv()
    prompt = list(range(48))
    compute(kv, make_seq("a", prompt))
    cached, num_cached = kv.get_computed_blocks(make_seq("b", prompt))
    assert (cached, num_cached) == ([0, 1], 32)  # the third block holds the last token


def test_cache_salt_separates_tenants() -> None:
    kv = make_kv()
    prompt = list(range(40))
    compute(kv, make_seq("a", prompt, salt="tenant-1"))
    assert kv.get_computed_blocks(make_seq("b", prompt, salt="tenant-2")) == ([], 0)
    assert kv.get_computed_blocks(make_seq("c", prompt, salt="tenant-1")) == ([0, 1], 32)


def test_freed_cached_blocks_are_evicted_oldest_first_tail_first() -> None:
    kv = make_kv(num_blocks=6)
    a = make_seq("a", list(range(50)))  # blocks 0-2 full and hashed, block 3 partial
    compute(kv, a)
    kv.free(a)
    # Partial block 3 to the front; hashed blocks to the back, tail first.
    assert kv.pool.free_block_ids == [3, 4, 5, 2, 1, 0]
    probe = make_seq("probe", list(range(50)))
    assert kv.get_computed_blocks(probe) == ([0, 1, 2], 48)

    c = make_seq("c", [9] * 48)
    assert kv.allocate_slots(c, 48)  # blocks 3, 4, 5: no eviction needed
    assert c.block_table == [3, 4, 5]
    assert kv.get_computed_blocks(probe) == ([0, 1, 2], 48)

    d = make_seq("d", [8] * 10)
    assert kv.allocate_slots(d, 10)  # evicts block 2, the tail of a's prefix
    assert d.block_table == [2]
    assert kv.pool.blocks[2].block_hash is None
    assert kv.get_computed_blocks(probe) == ([0, 1], 32)
    assert kv.pool.free_block_ids == [1, 0]


def test_reviving_free_cached_blocks_counts_against_free_space() -> None:
    kv = make_kv(num_blocks=3)
    a = make_seq("a", list(range(33)))
    compute(kv, a)
    kv.free(a)
    b = make_seq("b", list(range(32)) + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    cached, num_cached = kv.get_computed_blocks(b)
    assert (cached, num_cached) == ([0, 1], 32)
    # Two revived blocks plus one new block: exactly the three free blocks.
    assert kv.allocate_slots(b, b.num_tokens - num_cached, cached)
    assert b.block_table == [0, 1, 2]
    assert kv.num_free_blocks == 0
    c = make_seq("c", list(range(40)))
    cached, _ = kv.get_computed_blocks(c)
    assert cached == [0, 1]
    assert not kv.allocate_slots(c, 8, cached)  # the hits are shareable, the tail block is not
    assert ref_counts(kv) == [1, 1, 1]


def test_block_filled_during_decode_is_registered() -> None:
    kv = make_kv()
    seq = make_seq("a", list(range(15)))
    compute(kv, seq)
    assert kv.pool.blocks[0].block_hash is None
    seq.append_token(99)  # the 16th token fills block 0; its KV is not computed yet
    assert len(seq.block_hashes) == 1
    kv.cache_full_blocks(seq)
    assert kv.pool.blocks[0].block_hash is None  # a hash only points at written KV
    assert kv.allocate_slots(seq, 1)
    assert seq.block_table == [0]
    seq.num_computed_tokens = 16
    kv.cache_full_blocks(seq)
    assert kv.pool.blocks[0].block_hash == seq.block_hashes[0]
    other = make_seq("b", list(range(15)) + [99, 1])
    assert kv.get_computed_blocks(other) == ([0], 16)


def test_incremental_hashes_match_hashing_the_whole_sequence() -> None:
    seq = make_seq("a", list(range(7)), salt="s")
    for token in range(40):
        seq.append_token(1000 + token)
    assert seq.num_tokens == 47
    assert seq.block_hashes == prefix_block_hashes(seq.all_token_ids, BS, "s")
    assert seq.all_token_ids == list(range(7)) + [1000 + t for t in range(40)]


def test_duplicate_prefix_computed_twice_keeps_first_block() -> None:
    kv = make_kv()
    prompt = list(range(20))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    kv.allocate_slots(a, 20)
    kv.allocate_slots(b, 20)
    for seq in (a, b):
        seq.num_computed_tokens = 20
        kv.cache_full_blocks(seq)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
    kv.free(b)
    assert kv.pool.free_block_ids[:2] == [2, 3]
    assert kv.get_computed_blocks(make_seq("c", prompt)) == ([0], 16)


def test_prefix_caching_disabled() -> None:
    kv = make_kv(prefix=False)
    compute(kv, make_seq("a", list(range(40))))
    assert kv.get_computed_blocks(make_seq("b", list(range(40)))) == ([], 0)
    assert all(block.block_hash is None for block in kv.pool.blocks)
    assert kv.stats.queries == 0


def test_reset_prefix_cache() -> None:
    kv = make_kv()
    a = make_seq("a", list(range(40)))
    compute(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_seq("b", list(range(40)))) == ([], 0)
    assert all(block.block_hash is None for block in kv.pool.blocks)
    assert kv.num_free_blocks == 8


# ---- KV cache events ----------------------------------------------------------------


def replay(events: list[KVCacheEvent], cached: set[bytes] | None = None) -> set[bytes]:
    """The cached-hash set a subscriber rebuilds from the events."""
    cached = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()
    return cached


def test_no_events_are_kept_until_asked() -> None:
    kv = make_kv()
    compute(kv, make_seq("a", list(range(40))))
    assert kv.pool.events is None
    assert kv.take_events() == []


def test_stored_events_chain_blocks_with_their_tokens() -> None:
    kv = make_kv()
    kv.record_events()
    a = make_seq("a", list(range(40)))  # two full blocks, one partial
    compute(kv, a)
    [stored] = kv.take_events()
    assert stored == BlockStored(a.block_hashes[:2], None, list(range(32)))
    assert kv.take_events() == []

    a.append_token(7)  # decode fills no block yet: nothing new is cached
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    assert kv.take_events() == []
    for token in range(7):
        a.append_token(token)
    assert kv.allocate_slots(a, 7)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    [third] = kv.take_events()
    assert third.block_hashes == [a.block_hashes[2]]
    assert third.parent_block_hash == a.block_hashes[1]
    assert third.token_ids == a.all_token_ids[32:48]


def test_a_duplicate_block_splits_the_run_and_is_not_announced() -> None:
    kv = make_kv()
    kv.record_events()
    prompt = list(range(20))
    a, b = make_seq("a", prompt), make_seq("b", prompt + list(range(30)))
    kv.allocate_slots(a, 20)
    kv.allocate_slots(b, 50)
    for seq in (a, b):  # both computed block 0 in the same step
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
    first, rest = kv.take_events()
    assert first == BlockStored([a.block_hashes[0]], None, prompt[:16])
    assert rest.block_hashes == b.block_hashes[1:3]
    assert rest.parent_block_hash == b.block_hashes[0]  # cached, in a's block
    assert replay([first, rest]) == kv.pool.cached_hashes


def test_evictions_and_reset_are_announced() -> None:
    kv = make_kv(num_blocks=4)
    kv.record_events()
    a = make_seq("a", list(range(48)))
    compute(kv, a)
    kv.free(a)
    b = make_seq("b", [5] * 40)
    assert kv.allocate_slots(b, 40)  # block 3 is free; then blocks 2 and 1 are evicted
    events = kv.take_events()
    assert events[-1] == BlockRemoved([a.block_hashes[2], a.block_hashes[1]])
    assert replay(events) == kv.pool.cached_hashes == {a.block_hashes[0]}
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_events_rebuild_the_cached_set_under_a_random_workload() -> None:
    rng = random.Random(14)
    kv = make_kv(num_blocks=24)
    kv.record_events()
    rebuilt: set[bytes] = set()
    running: list[Sequence] = []
    stems = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]
    for step in range(400):
        if running and rng.random() < 0.3:
            kv.free(running.pop(rng.randrange(len(running))))
        if rng.random() < 0.5:
            stem = rng.choice(stems)[: rng.randrange(1, 41)]
            tokens = stem + [rng.randrange(50)] * rng.randrange(30)
            seq = make_seq(f"s{step}", tokens, salt=rng.choice([None, None, "t"]))
            cached, num_cached = kv.get_computed_blocks(seq)
            if kv.allocate_slots(seq, seq.num_tokens - num_cached, cached):
                seq.num_computed_tokens = seq.num_tokens
                kv.cache_full_blocks(seq)
                running.append(seq)
        for seq in running:  # a decode step each
            seq.append_token(rng.randrange(50))
            if kv.allocate_slots(seq, 1):
                seq.num_computed_tokens = seq.num_tokens
                kv.cache_full_blocks(seq)
        if rng.random() < 0.01:
            kv.reset_prefix_cache()
        replay(kv.take_events(), rebuilt)
        assert rebuilt == kv.pool.cached_hashes, f"step {step}"
    assert rebuilt, "the workload should leave something cached"
