"""N-gram drafting (prompt lookup): find the request's last n tokens earlier in its prompt
and output, and propose the tokens that followed them there.

n runs from `prompt_lookup_max` down to `prompt_lookup_min`: the longest n with a match
wins, and among its matches the earliest (vLLM's choice). One draft costs
O(len * prompt_lookup_max) in vectorized numpy, each pass one comparison over the tokens.
`NgramProposer` keeps each request's tokens in a growing int32 array, so a step pays
for the new tokens only, not for converting the whole list again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.model_free import ModelFreeDrafting


def ngram_draft(
    token_ids: Sequence[int] | npt.NDArray[np.integer], k: int, min_n: int, max_n: int
) -> list[int]:
    """Up to `k` drafted tokens for the sequence `token_ids` (prompt then output, 1-D);
    [] when its last `min_n` tokens occur nowhere earlier. A draft stops at the end of the
    sequence, so it can be shorter than `k`. Reads, never mutates."""
    tokens = np.asarray(token_ids)
    end = _longest_match_end(tokens, min_n, max_n)
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


class _TokenBuffer:
    """A request's tokens in an int32 array that doubles when full."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.array = np.empty(max(16, 2 * len(token_ids)), dtype=np.int32)
        self.length = 0
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        end = self.length + len(token_ids)
        if end > len(self.array):
            grown = np.empty(max(end, 2 * len(self.array)), dtype=np.int32)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        self.array[self.length : end] = token_ids
        self.length = end

    def view(self) -> npt.NDArray[np.int32]:
        return self.array[: self.length]


class NgramProposer(ModelFreeDrafting):
    """Prompt-lookup drafter for all of an engine's requests; the same lifecycle as
    `SuffixProposer`: `start_request`, `add_tokens` with every accepted token, `propose`,
    `finish_request`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_tokens = config.num_speculative_tokens
        self._requests: dict[str, _TokenBuffer] = {}

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Copy the prompt into the request's buffer."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        self._requests[request_id] = _TokenBuffer(prompt_token_ids)

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append the request's newly accepted output tokens (amortized O(len(token_ids)))."""
        self._requests[request_id].extend(token_ids)

    def propose(self, request_id: str, k: int) -> list[int]:
        """Up to min(k, num_speculative_tokens) tokens by `ngram_draft`; mutates nothing;
        KeyError for a request that was not started."""
        tokens = self._requests[request_id].view()
        return ngram_draft(tokens, min(k, self.max_tokens), self.min_n, self.max_n)

    def finish_request(self, request_id: str) -> None:
        """Forget the request; unknown ids pass (an abort before the start)."""
        self._requests.pop(request_id, None)
