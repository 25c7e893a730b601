"""The model-free drafters' definitions as plain searches: slow, obviously right, the
reference the drafters are tested and benchmarked against (tests/unit/test_spec_*.py,
bench/spec_drafters.py)."""

from __future__ import annotations


def naive_ngram_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """For n from max_n down, the earliest earlier copy of the last n tokens: what followed
    it, up to k tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def naive_suffix_draft(tokens: list[int], k: int, depth: int, min_prob: float) -> list[int]:
    """Suffix decoding over one sequence (max_spec_factor 1): for every match length m, the
    occurrences of the last m tokens and their most frequent continuation, scored by the
    sum of its running probabilities; the best-scoring draft."""
    best: list[int] = []
    best_score = 0.0
    length = len(tokens)
    for m in range(min(depth, length), 0, -1):
        pattern = tokens[length - m :]
        ends = [p for p in range(m - 1, length) if tokens[p - m + 1 : p + 1] == pattern]
        draft: list[int] = []
        score, probability = 0.0, 1.0
        while len(draft) < min(k, m) and m + len(draft) < depth:
            following = [tokens[p + 1] for p in ends if p + 1 < length]
            if not following:
                break
            token = min(set(following), key=lambda t: (-following.count(t), t))
            probability *= following.count(token) / len(following)
            if probability < min_prob:
                break
            draft.append(token)
            score += probability
            ends = [p + 1 for p in ends if p + 1 < length and tokens[p + 1] == token]
        if score > best_score:
            best, best_score = draft, score
    return best
