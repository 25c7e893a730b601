"""Suffix decoding (Arctic Inference, arXiv 2411.04975; vLLM's method "suffix"): drafts
from a suffix trie over the request's own prompt and output, and from a global trie over
the outputs of recently finished requests.

Each step the request's last tokens are matched in both tries at every length m up to
the tree depth; from each match the most frequent continuation is followed for at most
min(k, max_spec_factor * m) tokens while its estimated probability stays above
`min_token_prob`. The draft with the highest score (expected accepted length) wins; ties
go to the longer match, then to the request's own trie.

The global cache is bounded twice: by requests (`max_cached_requests`) and by memory
(`max_cached_nodes`); the oldest output is evicted first, as in vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.model_free import ModelFreeDrafting
from gpu_worker.spec_decode.suffix_trie import SuffixTrie, TrieNode, draft_from


class GlobalSuffixCache:
    """A suffix trie over finished requests' outputs, evicting the oldest past either bound."""

    def __init__(self, depth: int, max_requests: int, max_nodes: int) -> None:
        self.trie = SuffixTrie(depth)
        self.max_requests = max_requests
        self.max_nodes = max_nodes
        self._outputs: deque[list[int]] = deque()

    def __len__(self) -> int:
        return len(self._outputs)

    def outputs(self) -> list[list[int]]:
        """The cached outputs, oldest first (as kept: possibly cut to their last tokens)."""
        return list(self._outputs)

    def add(self, output_token_ids: Sequence[int]) -> None:
        """Cache one finished output (copied). An output that alone would pass the node
        bound keeps only its last tokens: each token adds at most `depth` nodes."""
        if self.max_requests == 0 or not output_token_ids:
            return
        tokens = list(output_token_ids[-max(1, (self.max_nodes - 1) // self.trie.depth) :])
        self.trie.extend(self.trie.start(), tokens)
        self._outputs.append(tokens)
        while len(self._outputs) > self.max_requests or self.trie.num_nodes > self.max_nodes:
            self.trie.remove(self._outputs.popleft())


@dataclass
class _RequestState:
    """A live request: its own trie, where its tokens end there, its last `depth` tokens
    (the pattern matched in the global trie) and its output (cached when it finishes)."""

    trie: SuffixTrie
    ends: list[TrieNode]
    last_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


class SuffixProposer(ModelFreeDrafting):
    """Suffix decoding drafter for all of an engine's requests; single-threaded.

    Lifecycle per request: `start_request` once, then `add_tokens` with every token the
    request accepts (in order), `propose` before each verify step, `finish_request` at
    the end (which moves its output into the global cache)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_tokens = config.num_speculative_tokens
        self.global_cache = GlobalSuffixCache(
            self.depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_cached_nodes,
        )
        self._requests: dict[str, _RequestState] = {}

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Build the request's own trie over its prompt (O(len * depth))."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        trie = SuffixTrie(self.depth)
        ends = trie.extend(trie.start(), prompt_token_ids)
        last = list(prompt_token_ids[-self.depth :])
        self._requests[request_id] = _RequestState(trie, ends, last)

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append the request's newly accepted output tokens (O(len(token_ids) * depth))."""
        state = self._requests[request_id]
        state.ends = state.trie.extend(state.ends, token_ids)
        state.last_token_ids = (state.last_token_ids + list(token_ids))[-self.depth :]
        state.output_token_ids.extend(token_ids)

    def propose(self, request_id: str, k: int) -> list[int]:
        """Up to min(k, num_speculative_tokens) drafted tokens; [] when nothing matches
        with enough probability. Reads the tries, mutates nothing; KeyError for a
        request that was not started."""
        state = self._requests[request_id]
        k = min(k, self.max_tokens)
        if k <= 0:
            return []
        # The request's own matches are its ends: ends[m] is the node of its last m tokens.
        own = [(m, state.ends[m]) for m in range(len(state.ends) - 1, 0, -1)]
        cached = self._matches(self.global_cache.trie, state.last_token_ids)
        best: list[int] = []
        best_score = 0.0
        for matches in (own, cached):
            for match_len, node in matches:
                limit = min(k, int(match_len * self.max_spec_factor + 1e-6))
                tokens, score = draft_from(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = tokens, score
        return best

    def num_nodes(self, request_id: str) -> int:
        """Nodes of the request's own trie: its memory, about len * depth when its tokens
        rarely repeat."""
        return self._requests[request_id].trie.num_nodes

    def finish_request(self, request_id: str) -> None:
        """Forget the request and cache its output in the global trie. Unknown ids pass,
        so a request aborted before `start_request` needs no special case."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.global_cache.add(state.output_token_ids)

    def _matches(self, trie: SuffixTrie, pattern: list[int]) -> list[tuple[int, TrieNode]]:
        """(m, node of the last m tokens) for each m the trie holds, the longest first.
        The trie holds every substring of what it holds, so the first miss ends the search."""
        found: list[tuple[int, TrieNode]] = []
        for match_len in range(1, len(pattern) + 1):
            node = trie.find(pattern[len(pattern) - match_len :])
            if node is None:
                break
            found.append((match_len, node))
        found.reverse()
        return found
