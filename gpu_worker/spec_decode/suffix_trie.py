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
    """One substring: how often it occurs, and the substrings one token longer.

    Most nodes have one child (a substring seen once continues one way), so a lone child
    sits in two slots (`token`, `child`) and a dict is made only for a second one: 64
    bytes a node instead of ~270 with a dict each."""

    __slots__ = ("child", "children", "count", "token")

    def __init__(self) -> None:
        self.count = 0
        self.token = -1
        self.child: TrieNode | None = None
        """The only child (under `token`) while there is one; None otherwise."""
        self.children: dict[int, TrieNode] | None = None
        """All children once a second one arrived (or after removals left fewer)."""

    def get(self, token: int) -> TrieNode | None:
        if self.child is not None:
            return self.child if token == self.token else None
        return None if self.children is None else self.children.get(token)

    def add(self, token: int) -> TrieNode:
        """The child under `token`, created (count 0) when absent."""
        found = self.get(token)
        if found is not None:
            return found
        created = TrieNode()
        if self.child is None and self.children is None:
            self.token, self.child = token, created
        else:
            if self.child is not None:
                self.children = {self.token: self.child}
                self.token, self.child = -1, None
            assert self.children is not None
            self.children[token] = created
        return created

    def delete(self, token: int) -> None:
        if self.child is not None:
            self.token, self.child = -1, None
        elif self.children is not None:
            del self.children[token]
            if not self.children:
                self.children = None

    def items(self) -> list[tuple[int, TrieNode]]:
        """(token, child) pairs; [] for a leaf."""
        if self.child is not None:
            return [(self.token, self.child)]
        return [] if self.children is None else list(self.children.items())

    def is_leaf(self) -> bool:
        return self.child is None and not self.children


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
                # The lone-child case inline: it is most of the calls of a long prompt.
                child = parent.child if parent.token == token else parent.get(token)
                if child is None:
                    child = parent.add(token)
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
                child = node.get(token)
                assert child is not None, "removing a sequence that was never added"
                child.count -= 1
                if child.count == 0:
                    # Its one occurrence was this one, so below it hangs only this path.
                    node.delete(token)
                    self.num_nodes -= _path_length(child)
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> TrieNode | None:
        """The node of the substring `tokens` (at most `depth` long), None when absent."""
        node: TrieNode | None = self.root
        for token in tokens:
            if node is None:
                return None
            node = node.get(token)
        return node


def _path_length(node: TrieNode) -> int:
    length = 1
    while not node.is_leaf():
        ((_, node),) = node.items()
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
    while len(tokens) < max_tokens and not node.is_leaf():
        if node.child is not None:  # one way on: probability unchanged
            best_token, best = node.token, node.child
        else:
            total = 0
            best_token, best = -1, node
            for token, child in node.items():
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
