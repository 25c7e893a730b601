"""Repetition, frequency and presence penalties from persistent per-request rows.

Each live request that uses a penalty holds one row of two tensors the sampler keeps from
step to step: what frequency and presence subtract from each token's logit (frequency x
its count in the output, plus presence once it is there: the request's constants times
its output-token counts), and which tokens its prompt or output holds (the repetition
penalty's mask). A row is taken on the request's first sampled step (the prompt and any
output so far are scattered in once); after that a step only scatters the tokens appended
since the last one, usually one per row, instead of rebuilding a dense [n, vocab] count
table from every token of every row. Applying them is then a gather and a subtraction,
plus four elementwise passes for the rows with a repetition penalty. A row comes back with
`release`, when the request leaves the running set (finished, aborted or preempted: a
preempted request takes a fresh row, rebuilt from its tokens, when it runs again).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gpu_worker.sampling.state import SamplerState, SamplingRequest
from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams

_INITIAL_ROWS = 8


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(eq=False)
class _Row:
    index: int
    """Its row in `PenaltyRows.subtract` and `.seen`."""
    owner: SamplerState
    """The request's state: a new request that reuses a finished one's id gets a fresh row
    even when the old one was never released."""
    num_counted: int = 0
    """Output tokens already in the row; the next step adds the ones after them."""
    in_output: set[int] = field(default_factory=set)
    """The distinct output tokens so far (host side): presence applies on the first."""


class PenaltyRows:
    """The persistent rows (what to subtract, which tokens were seen) of the live
    penalized requests."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.subtract = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        """[capacity, vocab] fp32: frequency_penalty x count + presence_penalty x (count >
        0), the counts those of the row's output tokens."""
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        """[capacity, vocab] bool: the tokens of the row's prompt and output."""
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []

    @property
    def num_live(self) -> int:
        """Rows held by requests now."""
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that left the running set; unknown ids (requests
        that never sampled with a penalty) are ignored."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free.append(row.index)

    def apply(
        self,
        x: torch.Tensor,
        batch_rows: Sequence[int],
        requests: Sequence[SamplingRequest],
        drafts_before: Sequence[list[int]] | None = None,
    ) -> None:
        """Penalize `x[batch_rows[i]]` ([n, vocab] logits, in place) for `requests[i]`:
        repetition (HF: prompt and output), then frequency and presence (OpenAI: output).

        Speculative decoding's verify rows (`drafts_before` given) each count the drafts
        before them as output too: row i is penalized as the sampler would penalize it
        after `requests[i]`'s output and then `drafts_before[i]`. A request may fill
        several rows; the persistent rows still count its output alone."""
        index = upload(self._sync(requests), torch.long, self.device)
        whole = len(batch_rows) == x.shape[0]  # then batch_rows is every row, in order
        rows = None if whole else upload(list(batch_rows), torch.long, self.device)
        xs = x if rows is None else x.index_select(0, rows)
        seen = self.seen.index_select(0, index)
        subtract = self.subtract.index_select(0, index)
        if drafts_before is not None:
            self._count_drafts(seen, subtract, requests, drafts_before)

        rep = [r.sampling.repetition_penalty for r in requests]
        if any(r != 1.0 for r in rep):
            # x / r where x > 0, x * r elsewhere, on seen tokens only: one scale per element.
            penalty = upload(rep, torch.float32, self.device)[:, None]
            scale = torch.where(xs > 0, penalty.reciprocal(), penalty)
            xs.mul_(torch.where(seen, scale, 1.0))
        if any(r.sampling.frequency_penalty or r.sampling.presence_penalty for r in requests):
            xs.sub_(subtract)
        if rows is not None:
            x.index_copy_(0, rows, xs)

    def _count_drafts(
        self,
        seen: torch.Tensor,
        subtract: torch.Tensor,
        requests: Sequence[SamplingRequest],
        drafts_before: Sequence[list[int]],
    ) -> None:
        """Add each row's drafts to its copies of the persistent rows (`seen`, `subtract`:
        [n, vocab], one per batch row), the way `_sync` adds output tokens: in order, so
        the sums round as they will once the drafts are output."""
        rows: list[int] = []
        cols: list[int] = []
        amounts: list[float] = []
        for i, (request, drafts) in enumerate(zip(requests, drafts_before, strict=True)):
            if not drafts:
                continue
            in_output = set(self._rows[request.request_id].in_output)
            frequency = request.sampling.frequency_penalty
            presence = request.sampling.presence_penalty
            for token in drafts:
                amounts.append(frequency + (presence if token not in in_output else 0.0))
                in_output.add(token)
            rows.extend([i] * len(drafts))
            cols.extend(drafts)
        if rows:
            at = (self._upload(rows), self._upload(cols))
            seen[at] = True
            values = upload(amounts, torch.float32, self.device)
            subtract.index_put_(at, values, accumulate=True)

    def _sync(self, requests: Sequence[SamplingRequest]) -> list[int]:
        """Each request's row, taken if it has none, with the tokens it gained since the
        last step added; one scatter per tensor for the whole batch."""
        fresh: list[int] = []
        seen_rows: list[int] = []
        seen_cols: list[int] = []
        sub_rows: list[int] = []
        sub_cols: list[int] = []
        sub_vals: list[float] = []
        indices: list[int] = []
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.owner is not request.sampler_state:
                row = _Row(self._take() if row is None else row.index, request.sampler_state)
                self._rows[request.request_id] = row
                fresh.append(row.index)
                # Validated by the engine; the filter keeps a stray id from indexing past a row.
                prompt = {t for t in request.prompt_token_ids if 0 <= t < self.vocab_size}
                seen_rows.extend([row.index] * len(prompt))
                seen_cols.extend(prompt)
            new = request.output_token_ids[row.num_counted :]
            row.num_counted += len(new)
            indices.append(row.index)
            if not new:
                continue
            frequency = request.sampling.frequency_penalty
            presence = request.sampling.presence_penalty
            for token in new:
                # Repeats within `new` are separate entries: index_put_ accumulates them.
                sub_vals.append(frequency + (presence if token not in row.in_output else 0.0))
                row.in_output.add(token)
            sub_rows.extend([row.index] * len(new))
            sub_cols.extend(new)
            seen_rows.extend([row.index] * len(new))
            seen_cols.extend(new)
        if fresh:
            reset = upload(fresh, torch.long, self.device)
            self.subtract.index_fill_(0, reset, 0.0)
            self.seen.index_fill_(0, reset, False)
        if seen_rows:
            at = (self._upload(seen_rows), self._upload(seen_cols))
            self.seen[at] = True
        if sub_rows:
            at = (self._upload(sub_rows), self._upload(sub_cols))
            values = upload(sub_vals, torch.float32, self.device)
            self.subtract.index_put_(at, values, accumulate=True)
        return indices

    def _upload(self, values: list[int]) -> torch.Tensor:
        return upload(values, torch.long, self.device)

    def _take(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        """Double the capacity (rows are only ever added, never moved)."""
        old = self.subtract.shape[0]
        new = max(_INITIAL_ROWS, 2 * old)
        subtract = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        subtract[:old] = self.subtract
        seen[:old] = self.seen
        self.subtract, self.seen = subtract, seen
        # Popped from the end: the lowest new index first.
        self._free.extend(range(new - 1, old - 1, -1))
