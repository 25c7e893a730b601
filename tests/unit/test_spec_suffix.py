"""Suffix decoding: the trie counts every short substring exactly however its tokens
arrive, drafts follow the most frequent continuation in the request or in the cached
outputs, and the global cache stays within its bounds over thousands of requests."""

from __future__ import annotations

import random
import sys
from typing import Any

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.suffix import GlobalSuffixCache, SuffixProposer
from gpu_worker.spec_decode.suffix_trie import SuffixTrie, TrieNode
from tests.helpers.spec_reference import naive_suffix_draft


def _dump(node: TrieNode) -> Any:
    """The trie as nested (count, {token: subtree}) for equality checks."""
    return (node.count, {token: _dump(child) for token, child in sorted(node.items())})


def _substring_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """The definition: occurrences of every substring of length 1..depth."""
    counts: dict[tuple[int, ...], int] = {}
    for tokens in sequences:
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + depth, len(tokens)) + 1):
                key = tuple(tokens[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], TrieNode]] = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def _config(**fields: Any) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", **{"num_speculative_tokens": 8, **fields})


def test_trie_counts_every_substring_whatever_the_chunking() -> None:
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    trie, chunked = SuffixTrie(4), SuffixTrie(4)
    for tokens in sequences:
        trie.extend(trie.start(), tokens)
        ends, cut = chunked.start(), 0
        while cut < len(tokens):
            step = rng.randrange(1, 5)
            ends = chunked.extend(ends, tokens[cut : cut + step])
            cut += step
    assert _trie_counts(trie) == _substring_counts(sequences, 4)
    assert _dump(chunked.root) == _dump(trie.root)
    assert trie.num_nodes == 1 + len(_substring_counts(sequences, 4))


def test_removing_a_sequence_leaves_the_trie_of_the_others() -> None:
    rng = random.Random(1)
    sequences = [[rng.randrange(4) for _ in range(20)] for _ in range(5)]
    trie = SuffixTrie(5)
    for tokens in sequences:
        trie.extend(trie.start(), tokens)
    for removed in range(len(sequences)):
        trie.remove(sequences[removed])
        rest = sequences[removed + 1 :]
        assert _trie_counts(trie) == _substring_counts(rest, 5)
        assert trie.num_nodes == 1 + len(_substring_counts(rest, 5))
    assert trie.root.is_leaf()


def test_copies_the_prompt() -> None:
    proposer = SuffixProposer(_config())
    proposer.start_request("r", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert proposer.num_nodes("r") == 1 + 10 * 11 // 2  # the root and every substring
    proposer.add_tokens("r", [0, 12, 13, 14])
    # The match "12 13 14" has length 3: max_spec_factor 1.0 drafts at most 3 tokens.
    assert proposer.propose("r", 8) == [15, 16, 17]
    proposer.add_tokens("r", [15, 16, 17])
    # A match of 6: past the prompt's end the draft runs on into the request's output.
    assert proposer.propose("r", 8) == [18, 19, 0, 12, 13, 14]
    assert proposer.propose("r", 1) == [18]


def test_the_most_frequent_continuation_wins() -> None:
    proposer = SuffixProposer(_config(suffix_decoding_min_token_prob=0.0))
    # After "1 2": 7 twice, 8 once.
    proposer.start_request("r", [1, 2, 8, 5, 1, 2, 7, 5, 1, 2, 7, 6, 1, 2])
    assert proposer.propose("r", 1) == [7]
    # A tie (6 after "7" once, 5 after "7" once) goes to the smaller token id.
    assert proposer.propose("r", 2) == [7, 5]


def test_min_token_prob_stops_the_draft() -> None:
    prompt = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 5, 7, 6, 1, 2]  # after "1 2": 3, 4 or 5
    loose = SuffixProposer(_config(suffix_decoding_min_token_prob=0.3))
    strict = SuffixProposer(_config(suffix_decoding_min_token_prob=0.4))
    loose.start_request("r", prompt)
    strict.start_request("r", prompt)
    assert loose.propose("r", 2) == [3, 9]
    assert strict.propose("r", 2) == []


def test_spec_factor_and_k_cap_the_draft() -> None:
    prompt = list(range(100, 120)) + [100, 101]
    wide = SuffixProposer(_config(num_speculative_tokens=16, suffix_decoding_max_spec_factor=3.0))
    wide.start_request("r", prompt)
    assert wide.propose("r", 16) == list(range(102, 108))  # 3 x a match of 2
    assert wide.propose("r", 4) == list(range(102, 106))
    capped = SuffixProposer(_config(num_speculative_tokens=2, suffix_decoding_max_spec_factor=3.0))
    capped.start_request("r", prompt)
    assert capped.propose("r", 16) == [102, 103]
    assert capped.propose("r", 0) == []


def test_finished_outputs_feed_later_requests() -> None:
    proposer = SuffixProposer(_config())
    proposer.start_request("first", [1, 2, 3])
    proposer.add_tokens("first", [40, 41, 42, 43, 44, 45])
    proposer.finish_request("first")
    proposer.start_request("second", [9, 9, 40, 41, 42])
    assert proposer.propose("second", 8) == [43, 44, 45]
    proposer.finish_request("never-started")  # an abort before the start passes
    off = SuffixProposer(_config(suffix_decoding_max_cached_requests=0))
    off.start_request("first", [1, 2, 3])
    off.add_tokens("first", [40, 41, 42, 43])
    off.finish_request("first")
    off.start_request("second", [40, 41])
    assert off.propose("second", 8) == []
    assert len(off.global_cache) == 0


def test_incremental_requests_equal_a_rebuild() -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(6) for _ in range(40)]
    output = [rng.randrange(6) for _ in range(60)]
    stepped, rebuilt = SuffixProposer(_config()), SuffixProposer(_config())
    stepped.start_request("r", prompt)
    cut = 0
    while cut < len(output):
        step = rng.randrange(1, 4)
        stepped.add_tokens("r", output[cut : cut + step])
        cut += step
        rebuilt.start_request("r", prompt + output[:cut])
        assert stepped.propose("r", 8) == rebuilt.propose("r", 8)
        rebuilt.finish_request("r")


def test_drafts_are_deterministic() -> None:
    def run() -> list[list[int]]:
        rng = random.Random(3)
        proposer = SuffixProposer(_config())
        drafts = []
        for request in range(20):
            rid = f"r{request}"
            proposer.start_request(rid, [rng.randrange(8) for _ in range(30)])
            for _ in range(10):
                proposer.add_tokens(rid, [rng.randrange(8) for _ in range(rng.randrange(1, 4))])
                drafts.append(proposer.propose(rid, 5))
            proposer.finish_request(rid)
        return drafts

    first = run()
    assert first == run()
    assert sum(map(len, first)) > 0


def test_cache_keeps_at_most_max_requests() -> None:
    cache = GlobalSuffixCache(depth=4, max_requests=3, max_nodes=10_000)
    for value in range(5):
        cache.add([value, value + 100, value + 200])
    assert len(cache) == 3
    assert cache.trie.find([0]) is None
    assert cache.trie.find([1]) is None
    assert cache.trie.find([2, 102]) is not None


def _held_bytes(cache: GlobalSuffixCache) -> tuple[int, int]:
    """(nodes reachable in the trie, bytes of those nodes, their child dicts and the
    cached outputs): what the cache really holds, not what it says it holds."""
    nodes, size = 0, 0
    stack = [cache.trie.root]
    while stack:
        node = stack.pop()
        nodes += 1
        size += sys.getsizeof(node)
        if node.children is not None:
            size += sys.getsizeof(node.children)
        stack.extend(child for _, child in node.items())
    size += sum(sys.getsizeof(tokens) for tokens in cache.outputs())
    return nodes, size


def test_cache_memory_stays_flat_over_2000_distinct_requests() -> None:
    """Random outputs share almost nothing, so each adds about length * depth nodes:
    unbounded, the trie would reach ~2000 * 40 * 6 nodes; bounded, it holds 2,000."""
    max_nodes = 2_000
    rng = random.Random(4)
    proposer = SuffixProposer(
        _config(suffix_decoding_max_tree_depth=6, suffix_decoding_max_cached_nodes=max_nodes)
    )
    cache = proposer.global_cache
    held: list[tuple[int, int]] = []
    for request in range(2_000):
        rid = f"r{request}"
        proposer.start_request(rid, [rng.randrange(50_000) for _ in range(8)])
        proposer.add_tokens(rid, [rng.randrange(50_000) for _ in range(32)])
        proposer.propose(rid, 4)
        proposer.finish_request(rid)
        assert cache.trie.num_nodes <= max_nodes
        if request % 500 == 499:
            held.append(_held_bytes(cache))
            assert held[-1][0] == cache.trie.num_nodes  # the count is the truth
    assert cache.trie.num_nodes > max_nodes // 2  # in use, not emptied
    assert 0 < len(cache) < 2_000
    sizes = [size for _, size in held]
    assert max(sizes) <= min(sizes) * 1.25, sizes
    # ~85 bytes a node with the outputs' lists; a dict in every node would be ~300.
    assert max(sizes) <= max_nodes * 128, sizes


def test_own_drafts_equal_a_plain_search() -> None:
    rng = random.Random(5)
    proposer = SuffixProposer(
        _config(suffix_decoding_max_tree_depth=7, suffix_decoding_max_cached_requests=0)
    )
    for request in range(40):
        rid = f"r{request}"
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        proposer.start_request(rid, tokens)
        for _ in range(8):
            step = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            proposer.add_tokens(rid, step)
            tokens += step
            k = rng.randrange(1, 9)
            assert proposer.propose(rid, k) == naive_suffix_draft(tokens, k, 7, 0.1), tokens
        proposer.finish_request(rid)
