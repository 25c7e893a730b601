"""allowed_token_ids and bad_words in the batched sampler: no work on a batch that has
neither, and no per-row tensor work on one that has them.

A request's filter (`TokenFilter`) is prepared once, when it arrives: its allowed ids, its
one-token bad words, and its longer words indexed by their prefix. The batch's tensors
(`BatchMasks`: each restricted row's disallowed tokens, the (row, token) pairs banned
whatever the output) are built when the batch's composition changes and reused while the
same requests sit in the same rows, as through a run of decode steps. A step then costs:
- allowed_token_ids: one `index_add_` of a 0 / -inf row per restricted row (selecting
  the rows, a bool `masked_fill_` and copying them back costs ~4x that on CPU:
  bench/RESULTS.md, sampler);
- one-token bad words: one scatter of -inf;
- longer bad words: one dictionary lookup per distinct prefix length, on the rows that
  have such words only (the output tail is host data), then one scatter of the matches.

A bad word is matched against the output only, as vLLM does: the last token of an n-token
word is banned when the output so far ends with its first n - 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


class HasOutput(Protocol):
    """A row as the filters read it: only its output so far."""

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass(eq=False)  # identity: a batch's masks are keyed by the filters in its rows
class TokenFilter:
    """One request's token restrictions, split the way the sampler applies them."""

    allowed: list[int] | None = None
    """Only these may be sampled; None: no restriction."""
    banned: list[int] = field(default_factory=list)
    """One-token bad words: never sampled."""
    banned_after: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    """Longer bad words: prefix length -> prefix -> the last tokens it bans."""


def new_token_filter(params: SamplingParams) -> TokenFilter | None:
    """The request's filter, or None when it restricts nothing."""
    if params.allowed_token_ids is None and not params.bad_words_token_ids:
        return None
    token_filter = TokenFilter(allowed=params.allowed_token_ids)
    for word in params.bad_words_token_ids:
        if len(word) == 1:
            token_filter.banned.append(word[0])
        else:
            prefixes = token_filter.banned_after.setdefault(len(word) - 1, {})
            prefixes.setdefault(tuple(word[:-1]), []).append(word[-1])
    return token_filter


class BatchMasks:
    """The tensors of one batch composition, built once and applied every step it lasts."""

    def __init__(
        self, filters: Sequence[TokenFilter | None], vocab_size: int, device: torch.device
    ) -> None:
        self.device = device
        restricted: list[int] = []
        allowed_rows: list[int] = []  # index into `restricted`, one per allowed id
        allowed_cols: list[int] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        self.prefixed: list[tuple[int, TokenFilter]] = []
        """(row, filter) of the rows with bad words of two or more tokens."""
        for row, token_filter in enumerate(filters):
            if token_filter is None:
                continue
            if token_filter.allowed is not None:
                allowed_rows.extend([len(restricted)] * len(token_filter.allowed))
                allowed_cols.extend(token_filter.allowed)
                restricted.append(row)
            ban_rows.extend([row] * len(token_filter.banned))
            ban_cols.extend(token_filter.banned)
            if token_filter.banned_after:
                self.prefixed.append((row, token_filter))

        self.restricted_rows: torch.Tensor | None = None
        self.allowed_bias: torch.Tensor | None = None
        """[len(restricted_rows), vocab] fp32: 0 on the row's allowed ids, -inf elsewhere."""
        if restricted:
            bias = torch.full((len(restricted), vocab_size), -torch.inf)
            bias[allowed_rows, allowed_cols] = 0.0
            self.restricted_rows = upload(restricted, torch.long, device)
            self.allowed_bias = bias.to(device)
        self.bans: tuple[torch.Tensor, torch.Tensor] | None = None
        if ban_rows:
            self.bans = (upload(ban_rows, torch.long, device), upload(ban_cols, torch.long, device))

    def apply(self, x: torch.Tensor, rows: Sequence[HasOutput]) -> None:
        """Set the logits of every token a row may not sample to -inf, in place."""
        if self.restricted_rows is not None and self.allowed_bias is not None:
            # Restricted rows are distinct: each element gets exactly one addition.
            x.index_add_(0, self.restricted_rows, self.allowed_bias)
        if self.bans is not None:
            x[self.bans] = -torch.inf
        if self.prefixed:
            self._ban_completions(x, rows)

    def _ban_completions(self, x: torch.Tensor, rows: Sequence[HasOutput]) -> None:
        """Ban the last token of each longer word whose prefix ends the row's output."""
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for row, token_filter in self.prefixed:
            output = rows[row].output_token_ids
            for length, prefixes in token_filter.banned_after.items():
                if len(output) >= length:
                    last = prefixes.get(tuple(output[-length:]))
                    if last is not None:
                        ban_rows.extend([row] * len(last))
                        ban_cols.extend(last)
        if ban_rows:
            index = (
                upload(ban_rows, torch.long, self.device),
                upload(ban_cols, torch.long, self.device),
            )
            x[index] = -torch.inf


class TokenFilters:
    """Applies the filters of a step's rows, keeping the masks of the last composition."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._filters: tuple[TokenFilter | None, ...] = ()
        self._masks: BatchMasks | None = None
        self.num_builds = 0
        """How many times the masks were built (tests and benchmarks watch it)."""

    def apply(
        self, x: torch.Tensor, filters: Sequence[TokenFilter | None], rows: Sequence[HasOutput]
    ) -> None:
        """Mask `x` ([n, vocab] logits, in place) by `filters[i]` for row i."""
        key = tuple(filters)
        # Tuples compare their items by identity first: same requests in the same rows.
        if self._masks is None or key != self._filters:
            self._masks = BatchMasks(key, self.vocab_size, self.device)
            self._filters = key
            self.num_builds += 1
        self._masks.apply(x, rows)
