"""N-gram drafting (prompt lookup): find the request's last n tokens earlier in its prompt
and output, and propose the tokens that followed them there.

n runs from `prompt_lookup_max` down to `prompt_lookup_min`: the longest n with a match
wins, and among its matches the earliest (vLLM's choice). One call costs
O(len * prompt_lookup_max) in vectorized numpy, each pass one comparison over the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class NgramProposer:
    """Stateless prompt-lookup drafter; `propose` reads the tokens it is given, nothing else."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | npt.NDArray[np.integer], k: int) -> list[int]:
        """Up to `k` drafted tokens for the sequence `token_ids` (prompt then output, 1-D);
        [] when its last `prompt_lookup_min` tokens occur nowhere earlier. A draft stops
        at the end of the sequence, so it can be shorter than `k`. Reads, never mutates."""
        tokens = np.asarray(token_ids)
        end = _longest_match_end(tokens, self.min_n, self.max_n)
        if end is None or k <= 0:
            return []
        return [int(token) for token in tokens[end + 1 : end + 1 + k]]


def _longest_match_end(tokens: npt.NDArray[np.integer], min_n: int, max_n: int) -> int | None:
    """Index j < len - 1 where the longest earlier copy (min_n <= n <= max_n) of the last
    n tokens ends, the earliest such j; None when no copy has at least min_n tokens."""
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return None
    # run[j]: tokens[j - d .. j] equals the last d + 1 tokens, for d = 0, 1, ... in turn;
    # matched[j] counts how many lengths held, i.e. the match length ending at j.
    run = tokens[: length - 1] == tokens[length - 1]
    matched = run.astype(np.int32)
    for d in range(1, max_n):
        if not run.any():
            break
        run[:d] = False
        run[d:] &= tokens[: length - 1 - d] == tokens[length - 1 - d]
        matched += run
    longest = int(matched.max())
    if longest < min_n:
        return None
    return int(np.argmax(matched == longest))
