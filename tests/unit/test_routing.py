"""The routing policy of render_server.worker_client.routing, without sockets."""

from __future__ import annotations

import pytest

from render_server.worker_client.routing import (
    AFFINITY_MAX_BLOCKS,
    PrefixAffinity,
    WorkerLoad,
    affinity_hashes,
    choose_worker,
    continuation,
    round_robin,
)
from shared.hashing import prefix_block_hashes
from shared.protocol import Generate
from shared.sampling import SamplingParams


def loads(*values: tuple[int, int, int]) -> list[WorkerLoad]:
    return [WorkerLoad(f"w{i}", *value) for i, value in enumerate(values)]


def test_least_loaded_counts_our_requests_and_the_workers_queue() -> None:
    # w0: 1 of ours + 4 running; w1: 3 of ours; w2: 0 of ours + 2 running + 2 waiting
    assert choose_worker(loads((1, 4, 0), (3, 0, 0), (0, 2, 2))) == 1
    assert choose_worker(loads((0, 0, 0), (3, 0, 0))) == 0


def test_ties_prefer_fewer_of_our_requests_then_rotate() -> None:
    # equal load 4: w1 has fewer of ours (its load is someone else's)
    assert choose_worker(loads((4, 0, 0), (1, 3, 0))) == 1
    idle = loads((0, 0, 0), (0, 0, 0), (0, 0, 0))
    assert [choose_worker(idle, rotation=r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_prefix_holder_wins_within_the_margin() -> None:
    candidates = loads((0, 0, 0), (2, 2, 0))
    assert choose_worker(candidates, preferred="w1", margin=4) == 1  # 4 <= 0 + 4
    busier = loads((0, 0, 0), (2, 2, 1))
    assert choose_worker(busier, preferred="w1", margin=4) == 0  # 5 > 0 + 4
    assert choose_worker(busier, preferred="w1", margin=5) == 1


def test_an_unknown_or_dead_preferred_worker_is_ignored() -> None:
    assert choose_worker(loads((3, 0, 0), (1, 0, 0)), preferred="gone") == 1


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidate workers"):
        choose_worker([])


def test_round_robin_takes_each_worker_in_turn() -> None:
    assert [round_robin(3, rotation) for rotation in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="no candidate workers"):
        round_robin(0, 0)


def test_longest_match_names_the_deepest_known_prefix() -> None:
    affinity = PrefixAffinity()
    shared_prefix = prefix_block_hashes(list(range(64)), block_size=16)  # 4 blocks
    affinity.record(shared_prefix[:2], "a")
    affinity.record(shared_prefix, "b")  # b saw the whole thing, and now also holds 0..1
    assert affinity.longest_match(shared_prefix) == ("b", 4)
    assert affinity.longest_match(shared_prefix[:3]) == ("b", 3)
    other = prefix_block_hashes(list(range(100, 164)), block_size=16)
    assert affinity.longest_match(other) == (None, 0)
    assert affinity.longest_match([]) == (None, 0)
    # a prompt that diverges after block 1 still matches the first two blocks
    diverging = prefix_block_hashes([*range(32), *range(500, 532)], block_size=16)
    assert affinity.longest_match(diverging) == ("b", 2)


def test_affinity_map_is_a_bounded_lru() -> None:
    affinity = PrefixAffinity(capacity=4)
    first = prefix_block_hashes(list(range(48)), block_size=16)  # 3 hashes
    second = prefix_block_hashes(list(range(1000, 1032)), block_size=16)  # 2 hashes
    affinity.record(first, "a")
    affinity.record(second, "b")
    assert len(affinity) == 4
    # the oldest entry (first[0]) went; deeper hashes of `first` are still known
    assert affinity.longest_match(first[:1]) == (None, 0)
    assert affinity.longest_match(first) == ("a", 3)
    # touching a hash again makes it recent
    affinity.record(first[1:2], "a")
    affinity.record(prefix_block_hashes([7] * 16, block_size=16), "c")
    assert affinity.longest_match(first[:2]) == ("a", 2)
    assert affinity.longest_match(first) == ("a", 2)  # first[2] was the oldest left
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        PrefixAffinity(capacity=0)


def request(prompt: list[int], **sampling: object) -> Generate:
    return Generate(request_id="r", prompt_token_ids=prompt, sampling=SamplingParams(**sampling))


def test_affinity_hashes_cover_the_first_full_blocks_with_the_salt() -> None:
    prompt = list(range(16 * (AFFINITY_MAX_BLOCKS + 3) + 5))
    hashes = affinity_hashes(request(prompt), block_size=16)
    assert len(hashes) == AFFINITY_MAX_BLOCKS
    assert hashes == prefix_block_hashes(prompt, 16)[:AFFINITY_MAX_BLOCKS]
    assert affinity_hashes(request(list(range(15))), block_size=16) == []
    salted = Generate(
        request_id="r", prompt_token_ids=prompt[:32], sampling=SamplingParams(), cache_salt="t1"
    )
    assert affinity_hashes(salted, 16) == prefix_block_hashes(prompt[:32], 16, cache_salt="t1")
    assert affinity_hashes(salted, 16) != prefix_block_hashes(prompt[:32], 16)


def test_continuation_appends_the_output_and_shrinks_the_budgets() -> None:
    original = request([1, 2, 3], temperature=0.0, max_tokens=10, min_tokens=4)
    resumed = continuation(original, [7, 8, 9])
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8, 9]
    assert resumed.sampling.max_tokens == 7
    assert resumed.sampling.min_tokens == 1
    assert resumed.sampling.temperature == 0.0
    assert resumed.request_id == "r"
    assert original.prompt_token_ids == [1, 2, 3]
    assert original.sampling.max_tokens == 10
    assert continuation(original, []) is original
