"""Repetition, frequency and presence penalties from persistent per-request rows.

Each live request that uses a penalty holds one row of two tensors the sampler keeps from
step to step: its output-token counts and its prompt's token mask. A row is taken on the
request's first sampled step (the prompt and any output so far are scattered in once);
after that a step only scatters the tokens appended since the last one, usually one per
row, instead of rebuilding a dense [n, vocab] table from every token of every row. A row
comes back with `release`, when the request leaves the running set (finished, aborted or
preempted: a preempted request takes a fresh row, rebuilt from its tokens, when it runs
again).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.sampling.state import SamplerState
from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams

_INITIAL_ROWS = 8


class PenalizedRequest(Protocol):
    """A row as the penalties read it."""

    @property
    def request_id(self) -> str: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def sampler_state(self) -> SamplerState: ...


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(eq=False)
class _Row:
    index: int
    """Its row in `PenaltyRows.counts` and `.prompt_seen`."""
    owner: SamplerState
    """The request's state: a new request that reuses a finished one's id gets a fresh row
    even when the old one was never released."""
    num_counted: int = 0
    """Output tokens already in the counts; the next step adds the ones after them."""


class PenaltyRows:
    """The persistent count and prompt-mask rows of the live penalized requests."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        """[capacity, vocab] fp32: how often each token is in the row's output."""
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        """[capacity, vocab] bool: the tokens of the row's prompt."""
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
        self, x: torch.Tensor, batch_rows: Sequence[int], requests: Sequence[PenalizedRequest]
    ) -> None:
        """Penalize `x[batch_rows[i]]` ([n, vocab] logits, in place) for `requests[i]`:
        repetition (HF: prompt and output), then frequency and presence (OpenAI: output)."""
        index = upload(self._sync(requests), torch.long, self.device)
        counts = self.counts.index_select(0, index)
        whole = len(batch_rows) == x.shape[0]  # then batch_rows is every row, in order
        rows = None if whole else upload(list(batch_rows), torch.long, self.device)
        xs = x if rows is None else x.index_select(0, rows)
        in_output = counts > 0

        params = [r.sampling for r in requests]
        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):
            seen = self.prompt_seen.index_select(0, index) | in_output
            penalty = upload(rep, torch.float32, self.device)[:, None]
            penalized = torch.where(xs > 0, xs / penalty, xs * penalty)
            xs = torch.where(seen, penalized, xs)
        freq = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        if any(freq) or any(presence):
            f = upload(freq, torch.float32, self.device)[:, None]
            p = upload(presence, torch.float32, self.device)[:, None]
            xs = xs - (f * counts + p * in_output)
        if rows is None:
            if xs is not x:
                x.copy_(xs)
        else:
            x.index_copy_(0, rows, xs)

    def _sync(self, requests: Sequence[PenalizedRequest]) -> list[int]:
        """Each request's row, taken if it has none, with the tokens it gained since the
        last step counted; one scatter for the whole batch."""
        fresh: list[int] = []
        prompt_rows: list[int] = []
        prompt_cols: list[int] = []
        count_rows: list[int] = []
        count_cols: list[int] = []
        indices: list[int] = []
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.owner is not request.sampler_state:
                if row is None:
                    row = _Row(self._take(), request.sampler_state)
                    self._rows[request.request_id] = row
                else:
                    row.owner, row.num_counted = request.sampler_state, 0
                fresh.append(row.index)
                # Validated by the engine; the filter keeps a stray id from indexing past a row.
                prompt = {t for t in request.prompt_token_ids if 0 <= t < self.vocab_size}
                prompt_rows.extend([row.index] * len(prompt))
                prompt_cols.extend(prompt)
            output = request.output_token_ids
            new = output[row.num_counted :]
            count_rows.extend([row.index] * len(new))
            count_cols.extend(new)
            row.num_counted = len(output)
            indices.append(row.index)
        if fresh:
            reset = upload(fresh, torch.long, self.device)
            self.counts.index_fill_(0, reset, 0.0)
            self.prompt_seen.index_fill_(0, reset, False)
        if prompt_rows:
            at = (
                upload(prompt_rows, torch.long, self.device),
                upload(prompt_cols, torch.long, self.device),
            )
            self.prompt_seen[at] = True
        if count_rows:
            at = (
                upload(count_rows, torch.long, self.device),
                upload(count_cols, torch.long, self.device),
            )
            ones = torch.ones(len(count_rows), dtype=torch.float32, device=self.device)
            self.counts.index_put_(at, ones, accumulate=True)
        return indices

    def _take(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        """Double the capacity (rows are only ever added, never moved)."""
        old = self.counts.shape[0]
        new = max(_INITIAL_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        seen[:old] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        # Popped from the end: the lowest new index first.
        self._free.extend(range(new - 1, old - 1, -1))
