"""Structured outputs on the worker: one llguidance matcher per constrained request, and
the batched token mask the sampler applies to constrained rows only.

Life of a constrained request (see shared.constraints for the grammar side):
- `Engine.add_request` compiles its matcher (`StructuredOutputs.new_matcher`); a constraint
  that does not compile is refused with `RequestRejected("invalid_request", ...)`.
- Every step it samples in, `GrammarMasker.apply` fills one bitmask row per constrained
  row (in parallel, on llguidance's thread pool), uploads it and sets the logits of
  disallowed tokens to -inf before any other logit processing. Unconstrained rows are
  never touched, and a batch without constraints pays one pass over its states.
- A JSON constraint's rows also refuse the tokens that would repeat a key in an object
  (`json_keys`: the one rule a grammar cannot hold).
- After the scheduler appends the sampled token, `RequestMatcher.sync` feeds it to the
  matcher. A stopped matcher (the grammar is complete: only EOS could follow) ends the
  request with "stop" at once, without spending a step on EOS.

Preemption: the scheduler keeps a preempted sequence's output tokens and recomputes
prompt + output; the next token it samples follows the last output token. So a matcher
that consumed exactly the output tokens stays valid across preemption. `sync` holds that
invariant explicitly: it rolls the matcher back if the output ever shrinks and catches up
if tokens were appended elsewhere, so a change in the engine cannot desync the two.

The worker never loads the render tier's tokenizer; llguidance only needs every token's
bytes, which `vocab.lltokenizer_from_source` reads from the model files (tokenizer.json,
or the GGUF vocabulary decoded byte-level) without the `tokenizers` package.
"""

from __future__ import annotations

import logging
import threading

import llguidance
import numpy as np
import torch

from gpu_worker.sampling.json_keys import KeyGuard, QuoteTokens
from gpu_worker.sampling.vocab import lltokenizer_from_source
from shared.constraints import ConstraintError, new_matcher
from shared.model_source import ModelSource
from shared.protocol import Constraint

logger = logging.getLogger(__name__)

_JSON_KINDS = frozenset({"json_schema", "json_object"})
"""Constraints whose output is JSON: their matchers get a KeyGuard."""


class RequestMatcher:
    """One request's matcher and how many of its output tokens it has consumed.

    With a `gate` (the end tag of the model's reasoning, e.g. `</think>`), the constraint
    applies only to the output after the gate: reasoning is free text, and the answer
    must match. Until the gate appears in the output the row is not masked at all.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        gate: bytes | None = None,
        tokenizer: llguidance.LLTokenizer | None = None,
        keys: KeyGuard | None = None,
    ) -> None:
        self.matcher = matcher
        self.num_consumed = 0
        self.keys = keys
        """For a JSON constraint (needs `tokenizer`): refuses a key repeated in an object."""
        self._gate = gate
        self._tokenizer = tokenizer
        self._gate_tail = b""
        self._gate_scanned = 0
        self._offset = 0
        """Output tokens before the constrained part (the reasoning, gate included)."""

    @property
    def is_active(self) -> bool:
        """The constraint applies now (no gate, or the gate was passed)."""
        return self._gate is None

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (also true in the error state)."""
        return self.is_active and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a refused token, a grammar out of fuel), or None."""
        if not self.is_active or not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the constraint failed"

    def _watch_gate(self, output_token_ids: list[int]) -> None:
        assert self._gate is not None and self._tokenizer is not None
        new = output_token_ids[self._gate_scanned :]
        self._gate_scanned = len(output_token_ids)
        if not new:
            return
        self._gate_tail += self._tokenizer.decode_bytes(new)
        if self._gate in self._gate_tail:
            # Tags like </think> are single tokens in the models that use them, so the
            # answer starts at the next token.
            self._gate = None
            self._offset = len(output_token_ids)
        else:
            self._gate_tail = self._gate_tail[-len(self._gate) :]

    def num_valid_drafts(self, draft_token_ids: list[int]) -> int:
        """How many of the drafts, from the first, speculative decoding may verify after
        the output this matcher consumed: the head the grammar accepts, short of the draft
        that would complete it (plain decoding ends the request right after that token,
        which verification cannot do within a step). Behind a gate, the head short of the
        draft that would pass the gate (the rows after it would need the grammar's masks
        from its start). The matcher's state is unchanged."""
        if self._gate is not None:
            assert self._tokenizer is not None
            tail = self._gate_tail
            for count, token_id in enumerate(draft_token_ids):
                tail += self._tokenizer.decode_bytes([token_id])
                if self._gate in tail:
                    return count
            return len(draft_token_ids)
        head = self._without_repeated_keys(
            draft_token_ids[: self.matcher.validate_tokens(draft_token_ids)]
        )
        consumed = 0
        stopped = False
        for token_id in head:
            self.matcher.consume_token(token_id)
            consumed += 1
            stopped = self.matcher.is_stopped()
            if stopped:
                break
        if consumed:
            self.matcher.rollback(consumed)
        return consumed - 1 if stopped else consumed

    def _without_repeated_keys(self, draft_token_ids: list[int]) -> list[int]:
        """The head of the drafts short of the first that would repeat a key."""
        if self.keys is None:
            return draft_token_ids
        assert self._tokenizer is not None
        keys = self.keys.copy()
        for count, token_id in enumerate(draft_token_ids):
            text = self._tokenizer.decode_bytes([token_id])
            if keys.would_repeat(text):
                return draft_token_ids[:count]
            keys.feed(text)
        return draft_token_ids

    def refuse_repeated_keys(self, rows: np.ndarray, draft_token_ids: list[int]) -> None:
        """Clear, in this request's bitmask rows (uint32 words; row j after the first j
        drafts), the tokens that would repeat a key of the object being written."""
        if self.keys is None:
            return
        assert self._tokenizer is not None
        keys = self.keys if not draft_token_ids else self.keys.copy()
        for j, words in enumerate(rows):
            keys.refuse(words)
            if j < len(draft_token_ids):
                keys.feed(self._tokenizer.decode_bytes([draft_token_ids[j]]))

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's consumed tokens equal the constrained part of the output."""
        if self._gate is not None:
            self._watch_gate(output_token_ids)
            if self._gate is not None:
                return
        output_token_ids = output_token_ids[self._offset :]
        num_output = len(output_token_ids)
        if self.num_consumed > num_output:  # the engine dropped tokens: undo them
            self.matcher.rollback(self.num_consumed - num_output)
            if self.keys is not None:
                self.keys.rollback(self.num_consumed - num_output)
            self.num_consumed = num_output
        if self.num_consumed < num_output:
            new = output_token_ids[self.num_consumed :]
            # A refused token leaves the matcher in its error state, which the engine
            # turns into a finished request; masking makes that unreachable in practice.
            self.matcher.consume_tokens(new)
            if self.keys is not None:
                assert self._tokenizer is not None
                for token_id in new:
                    self.keys.feed(self._tokenizer.decode_bytes([token_id]))
            self.num_consumed = num_output


class StructuredOutputs:
    """The worker's structured-output support: the tokenizer view and matcher factory.

    Building llguidance's tokenizer takes a noticeable fraction of a second for a 50k
    vocabulary (bench/RESULTS.md, Constraint costs), so `start_loading`
    runs it on a background thread when the engine starts, and the first constrained
    request does not stall the step loop.
    """

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.source = source
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._quote_tokens: QuoteTokens | None = None
        self._load_error: str | None = None
        self._loader: threading.Thread | None = None

    def start_loading(self) -> None:
        """Build the tokenizer view on a background thread."""
        if self._loader is None and self._tokenizer is None:
            self._loader = threading.Thread(
                target=self._load, name="structured-outputs-vocab", daemon=True
            )
            self._loader.start()

    def _load(self) -> None:
        try:
            tokenizer = lltokenizer_from_source(self.source, self.vocab_size, self.eos_token_ids)
            self._quote_tokens = QuoteTokens(tokenizer)
            self._tokenizer = tokenizer  # last: its being set says both are ready
        except Exception as exc:  # reported to each constrained request instead
            logger.exception("structured outputs unavailable")
            self._load_error = f"structured outputs are unavailable on this worker: {exc}"

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer view (waits for the background build); ConstraintError if none."""
        if self._tokenizer is None and self._load_error is None:
            self.start_loading()
            assert self._loader is not None
            self._loader.join()
        if self._tokenizer is None:
            raise ConstraintError(self._load_error or "structured outputs are unavailable")
        return self._tokenizer

    def new_matcher(self, constraint: Constraint, prompt_token_ids: list[int]) -> RequestMatcher:
        """A matcher for a new request; ConstraintError if the constraint does not compile
        or the resumed tokens (a failover's earlier output) do not match it."""
        gate = constraint.start_after.encode() if constraint.start_after else None
        tokenizer = self.tokenizer
        keys = None
        if constraint.kind in _JSON_KINDS:
            assert self._quote_tokens is not None  # built with the tokenizer
            keys = KeyGuard(self._quote_tokens)
        matcher = RequestMatcher(new_matcher(constraint, tokenizer), gate, tokenizer, keys)
        resumed = constraint.num_resumed_tokens
        if resumed:
            if resumed > len(prompt_token_ids):
                raise ConstraintError("num_resumed_tokens exceeds the prompt")
            matcher.sync(prompt_token_ids[-resumed:])
            if matcher.error is not None:
                raise ConstraintError(f"resumed tokens do not match: {matcher.error}")
            # They are prompt tokens here: `sync` counts (and may roll back) output only.
            matcher.num_consumed = 0
            matcher._gate_scanned = matcher._offset = 0
        return matcher


class GrammarMasker:
    """Applies the constrained rows' token masks to one step's logits."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.num_words = (vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None
        self._host: torch.Tensor | None = None
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[RequestMatcher]) -> None:
        """Set logits[rows[i], t] = -inf for every token t that matchers[i] disallows."""
        self._mask(logits, rows, self.fill(matchers))

    def apply_drafted(
        self,
        logits: torch.Tensor,
        first_rows: list[int],
        matchers: list[RequestMatcher],
        draft_token_ids: list[list[int]],
    ) -> None:
        """Mask a verify step's rows: request i's k + 1 rows start at `first_rows[i]`, and
        row j gets the mask of `matchers[i]` after it consumed the first j of its k drafts
        (`draft_token_ids[i]`, which the grammar accepts: `num_valid_drafts`). The
        matchers end in the state they started in."""
        rows = [
            first + j
            for first, drafts in zip(first_rows, draft_token_ids, strict=True)
            for j in range(len(drafts) + 1)
        ]
        self._mask(logits, rows, self.fill_drafted(matchers, draft_token_ids))

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        vocab = logits.shape[1]
        if self.device.type == "cuda":
            # Unpacked on the device: 32x less to copy than a per-token mask.
            packed = bitmask.to(self.device, non_blocking=True)
            disallowed = ((packed[:, :, None] >> self._bits) & 1) == 0
            disallowed = disallowed.view(len(rows), -1)[:, :vocab]
        else:
            # numpy's unpackbits is much faster than torch bit ops on a CPU.
            inverted = np.invert(bitmask.numpy().view(np.uint8))
            bits = np.unpackbits(inverted, axis=1, count=vocab, bitorder="little")
            disallowed = torch.from_numpy(bits).view(torch.bool)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(disallowed, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long)
            if self.device.type == "cuda":  # pinned, so the copy does not sync the stream
                index = index.pin_memory().to(self.device, non_blocking=True)
            logits[index] = logits[index].masked_fill(disallowed, float("-inf"))

    def fill(self, matchers: list[RequestMatcher]) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32 bitmask on the host, bit t = allowed."""
        n = len(matchers)
        host = self._host_rows(n)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, row) for row, m in enumerate(matchers)],
            host.data_ptr(),
            self.num_words * 4,
            n,
        )
        words = host.numpy().view(np.uint32)
        for row, m in enumerate(matchers):
            m.refuse_repeated_keys(words[row : row + 1], [])
        self._allow_eos_only([row for row, m in enumerate(matchers) if m.matcher.is_error()])
        return host

    def fill_drafted(
        self, matchers: list[RequestMatcher], draft_token_ids: list[list[int]]
    ) -> torch.Tensor:
        """[sum(k_i + 1), ceil(vocab / 32)] int32 host bitmask: matcher i's k_i + 1 rows
        in order, row j after its first j drafts (see `apply_drafted`)."""
        n = sum(len(d) + 1 for d in draft_token_ids)
        host = self._host_rows(n)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        first_rows: list[int] = []
        first = 0
        for drafts in draft_token_ids:
            first_rows.append(first)
            first += len(drafts) + 1
        # llguidance advances each matcher through its drafts, fills a row per state and
        # rolls it back: the masks of every depth in one parallel call.
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [
                (m.matcher, first, drafts)
                for m, first, drafts in zip(matchers, first_rows, draft_token_ids, strict=True)
            ],
            host.data_ptr(),
            self.num_words * 4,
            n,
        )
        words = host.numpy().view(np.uint32)
        for m, first, drafts in zip(matchers, first_rows, draft_token_ids, strict=True):
            m.refuse_repeated_keys(words[first : first + len(drafts) + 1], drafts)
        errored = [
            first + j
            for m, first, drafts in zip(matchers, first_rows, draft_token_ids, strict=True)
            if m.matcher.is_error()
            for j in range(len(drafts) + 1)
        ]
        self._allow_eos_only(errored)
        return host

    def _allow_eos_only(self, rows: list[int]) -> None:
        """Rows of matchers in their error state allow EOS only, so they stay finite; the
        engine then ends those requests."""
        assert self._host is not None
        for row in rows:
            self._host[row].zero_()
            for token_id in self.eos_token_ids:
                self._host[row, token_id // 32] |= _bit(token_id % 32)

    def _host_rows(self, n: int) -> torch.Tensor:
        # One reused host buffer: the previous step's copy from it finished at that
        # step's sync (the sampler's .tolist()), so overwriting it now is safe.
        if self._host is None or self._host.shape[0] < n:
            capacity = max(n, 2 * self._host.shape[0] if self._host is not None else 8)
            self._host = torch.empty(
                capacity, self.num_words, dtype=torch.int32, pin_memory=self.device.type == "cuda"
            )
        return self._host[:n]


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores."""
    value = 1 << position
    return value - (1 << 32) if position == 31 else value
