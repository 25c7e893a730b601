"""A depth-bounded suffix trie with counts: the data structure behind suffix decoding.

The trie holds every substring of length <= `depth` of the sequences put into it, and
each node counts the occurrences of its substring. A sequence grows append-only: its
`ends` (the nodes of its last 0..depth tokens) advance by one level per token, so adding
a token costs O(depth) and adding tokens in any chunking builds the same trie as adding
them at once. Removing a sequence subtracts exactly what adding it added.
"""

from __future__ import annotations

from collections.abc import Sequence


class TrieNode:
    """One substring: how often it occurs, and the substrings one token longer."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] | None = None


class SuffixTrie:
    """Counts of all substrings of length <= `depth` over a multiset of sequences."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = TrieNode()
        self.num_nodes = 1
        """Nodes held, the root included: the trie's memory in units of one node."""

    def start(self) -> list[TrieNode]:
        """The `ends` of an empty sequence: only the root (the empty suffix)."""
        return [self.root]

    def extend(self, ends: list[TrieNode], tokens: Sequence[int]) -> list[TrieNode]:
        """Append `tokens` to the sequence whose suffix nodes are `ends` (ends[m] is the
        node of its last m tokens) and return the new ends; `ends` is not mutated."""
        for token in tokens:
            advanced = [self.root]
            for parent in ends[: self.depth]:
                children = parent.children
                if children is None:
                    children = parent.children = {}
                child = children.get(token)
                if child is None:
                    child = children[token] = TrieNode()
                    self.num_nodes += 1
                child.count += 1
                advanced.append(child)
            ends = advanced
        return ends

    def remove(self, tokens: Sequence[int]) -> None:
        """Take out one sequence added earlier with exactly these tokens (in one or more
        `extend` calls); nodes left with no occurrence are freed."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                assert node.children is not None, "removing a sequence that was never added"
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    # Its one occurrence was this one, so below it hangs only this path.
                    del node.children[token]
                    if not node.children:
                        node.children = None
                    self.num_nodes -= _path_length(child)
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> TrieNode | None:
        """The node of the substring `tokens` (at most `depth` long), None when absent."""
        node = self.root
        for token in tokens:
            if node.children is None:
                return None
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node


def _path_length(node: TrieNode) -> int:
    length = 1
    while node.children:
        (node,) = node.children.values()
        length += 1
    return length


def draft_from(node: TrieNode, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent child from `node` for at most `max_tokens` tokens while
    the path's estimated probability stays >= `min_token_prob`; return the tokens and the
    score (the sum of each token's path probability, the expected accepted length).

    A token's probability is its count over its siblings' total: occurrences that end at
    a sequence's end (the request's own latest suffix among them) have no continuation
    and so do not dilute it. Ties go to the smaller token id, so drafts are deterministic."""
    tokens: list[int] = []
    score = 0.0
    probability = 1.0
    while len(tokens) < max_tokens and node.children:
        total = 0
        best_token, best = -1, node
        for token, child in node.children.items():
            total += child.count
            if best_token < 0 or (child.count, -token) > (best.count, -best_token):
                best_token, best = token, child
        probability *= best.count / total
        if probability < min_token_prob:
            break
        tokens.append(best_token)
        score += probability
        node = best
    return tokens, score
