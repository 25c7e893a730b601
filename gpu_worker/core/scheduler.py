"""Continuous batching with chunked prefill, a token budget and preemption by recompute.

One step: running sequences first (decodes and continuing prefill chunks), then waiting
ones, until the token budget or `max_num_seqs` runs out. There is no prefill phase: each
sequence gets `num_new_tokens` toward its known tokens, and only one whose scheduled
tokens reach the end of them is sampled.

Order: every sequence has a key, `(priority, arrival_order)` under the "priority" policy
and `(0, arrival_order)` under "fcfs". Invariant: `waiting` and `running` are both sorted
by it, so `waiting[0]` is admitted first (head-of-line blocking: nobody overtakes it),
running sequences get the budget in key order, and `running[-1]` is preempted first. A
preempted sequence goes back into `waiting` at its key, under "fcfs" its front: nothing
newer than it was admitted before it.

Progress advances when a sequence is scheduled, as in vLLM v1: `num_computed_tokens`
counts the tokens of every scheduled step, and a step that samples leaves one token
unresolved (`Sequence.num_unresolved`) until `update` appends it. With async scheduling
the next step is scheduled before `update` of this one: a decoding sequence then computes
its unresolved token, whose id the runner takes from the previous step's samples on the
device, and a sequence that `update` then finds finished has its extra token dropped.

Speculative decoding: a running sequence that decodes may carry drafts (the speculator
proposes them into `Sequence.draft_token_ids` before `schedule`); it is scheduled for
1 + k tokens (its last known token and the drafts the budget and the cache allow) with KV
slots for all of them, and `update` keeps the verified head, setting its progress to the
kept tokens and freeing the blocks only rejected drafts used.

LoRA: the running set holds at most `max_loras` distinct adapters (the runner's slots).
A waiting request of a further adapter is the one exception to head-of-line order: base
requests behind it may pass, adapter requests may not (see `schedule`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpu_worker.core.config import SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.outputs import ModelRunnerOutput
from gpu_worker.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: `num_new_tokens` tokens from `num_computed_tokens`."""

    seq: Sequence
    num_computed_tokens: int
    """Position of the first scheduled token (the sequence's progress before this step)."""
    num_new_tokens: int
    will_sample: bool
    """The scheduled tokens reach the end of the known tokens, so the last one's logits
    give a new token; False for a prefill chunk that is not the last."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Drafted tokens scheduled after the last known one (`num_new_tokens` counts them):
    the step verifies them from the logits at all 1 + k positions."""

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token: empty unless
        the sequence needs prompt logprobs. Position p scores prompt token p + 1."""
        if not self.seq.needs_prompt_logprobs:
            return range(0)
        start = self.num_computed_tokens
        end = min(start + self.num_new_tokens, self.seq.num_prompt_tokens - 1)
        return range(start, max(start, end))


@dataclass
class SchedulerOutput:
    """What the model runs this step, in batch order, and who was preempted to make room."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that left the running set since the previous `schedule()` (finished,
    aborted or preempted: their blocks are freed), each handed out once, as in vLLM v1:
    the runner and the sampler drop their per-request rows for them. Released before this
    step's sequences are laid out, so an id reused by a new request gets a fresh row."""
    shrunk_request_ids: list[str] = field(default_factory=list)
    """Set by `update`: running sequences whose block tables lost their tail (rejected
    drafts' blocks freed); the runner rewrites their rows."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = scheduler_config
        self.kv = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_cache_tokens = kv_cache_manager.num_blocks * kv_cache_manager.block_size
        # A sequence longer than the whole cache could never compute its next token, so
        # it stops with "length" there (else it would preempt itself forever).
        self.max_seq_len = min(scheduler_config.max_model_len, self.num_cache_tokens + 1)
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._left_running: list[str] = []
        """Ids for the next `SchedulerOutput.finished_request_ids`."""

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_admissible(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request can never run here, or None. The engine rejects it with this."""
        if prompt_len < 1:
            return "prompt is empty"
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}"
        if prompt_len + 1 > self.config.max_model_len:
            return (
                f"prompt has {prompt_len} tokens; max_model_len {self.config.max_model_len} "
                "leaves no room for output"
            )
        if prompt_len > self.num_cache_tokens:
            return (
                f"prompt has {prompt_len} tokens, more than the whole KV cache holds "
                f"({self.num_cache_tokens})"
            )
        return None

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. The engine validated it (`check_admissible`, unique id)."""
        seq.status = SequenceStatus.WAITING
        seq.arrival_order = next(self._arrivals)
        self.requests[seq.request_id] = seq
        bisect.insort(self.waiting, seq, key=self._key)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[Sequence]:
        """End these with `reason` and free their blocks now (an abort, or a grammar that
        completed); unknown or already finished ids are skipped."""
        finished: list[Sequence] = []
        for request_id in request_ids:
            seq = self.requests.get(request_id)
            if seq is None:
                continue
            seq.finish(reason)
            self._leave(seq)
            finished.append(seq)
        return finished

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; each scheduled sequence's progress advances with it."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running first: they hold blocks, and decodes keep latency low.
        budget = self._schedule_running(out, budget)

        # Then admit waiting ones, unless this step had to preempt: blocks are short.
        adapters = self._running_adapters()
        waits_for_adapter = False
        i = 0
        while (
            i < len(self.waiting)
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[i]
            if seq.num_unresolved:
                break  # preempted with a token in flight: it returns once that is known
            if seq.lora_name is not None and (
                waits_for_adapter or not self._adapter_fits(seq.lora_name, adapters)
            ):
                # No slot for its adapter: base requests behind it may pass (they need
                # none), no adapter request may, so the running adapters drain and it
                # gets its slot.
                waits_for_adapter = True
                i += 1
                continue
            cached_blocks: list[int] = []
            num_cached = 0
            if not seq.needs_prompt_logprobs:  # else every prompt position must be computed
                cached_blocks, num_cached = self.kv.get_computed_blocks(seq)
            num_new = self._num_new_tokens(seq, num_cached, budget)
            if not self.kv.allocate_slots(seq, num_new, cached_blocks):
                break  # nobody overtakes the head of the queue
            self.waiting.pop(i)
            if seq.lora_name is not None:
                adapters.add(seq.lora_name)
            if seq.status == SequenceStatus.WAITING:  # its first step, not a recompute
                seq.num_cached_tokens = num_cached
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            self._emit(out, seq, num_cached, num_new)
            budget -= num_new
        out.finished_request_ids, self._left_running = self._left_running, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give the running sequences their tokens in order, preempting from the back
        when blocks run out; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_unresolved(seq):
                i += 1  # its unresolved token ends it: nothing left to compute
                continue
            num_new = self._num_new_tokens(seq, seq.num_computed_tokens, budget)
            drafts = self._drafts(seq, num_new, budget)
            if drafts and self.kv.allocate_slots(seq, num_new + len(drafts)):
                self._emit(out, seq, seq.num_computed_tokens, num_new + len(drafts), drafts)
                budget -= num_new + len(drafts)
                i += 1
                continue
            # No room for the drafts: decode plainly, preempting as without speculation.
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the last in order; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._emit(out, seq, seq.num_computed_tokens, num_new)
                budget -= num_new
                i += 1
        return budget

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """Apply a finished step: cache the blocks it filled, append its tokens, check stops.

        `result` holds the tokens of every scheduled sequence that sampled: one, or for a
        sequence with drafts the ones verification kept (its accepted drafts then the
        target's token). Returns the sequences that got tokens (finished ones included,
        blocks freed); a sequence that finished or was aborted since `schedule` has its
        tokens dropped.
        """
        changed: list[Sequence] = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted, or ended by a step before this one
                continue
            if seq.status == SequenceStatus.RUNNING:
                end = item.num_computed_tokens + item.num_new_tokens - len(item.draft_token_ids)
                self.kv.cache_full_blocks(seq, end)
            if not item.will_sample:
                continue
            seq.num_unresolved -= 1
            if item.draft_token_ids:
                self._keep_verified(output, seq, result.sampled_token_ids[seq.request_id])
            else:
                token_id = result.sampled_token_ids[seq.request_id][0]
                seq.append_token(token_id)
                self._check_stop(seq, token_id)
            if seq.is_finished:
                self._leave(seq)
            changed.append(seq)
        return changed

    def _leave(self, seq: Sequence) -> None:
        """A finished sequence leaves its queue (waiting when it had not started, or was
        preempted with a token in flight) and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self._left_running.append(seq.request_id)
        else:
            self.waiting.remove(seq)
        self._release(seq)

    def _keep_verified(self, output: SchedulerOutput, seq: Sequence, kept: list[int]) -> None:
        """Append the verified tokens one by one, as plain decoding would have, stopping at
        the first that ends the sequence; KV stays valid up to the last kept draft."""
        for token_id in kept:
            seq.append_token(token_id)
            self._check_stop(seq, token_id)
            if seq.is_finished:
                break
        # Every appended token but the last was an input of this step: its KV was written
        # (the last one's comes with the next step, as after a plain decode).
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens)
        if not seq.is_finished and self.kv.trim(seq, seq.num_computed_tokens):
            output.shrunk_request_ids.append(seq.request_id)

    def _drafts(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts `seq` carries, as many as fit: only a decoding sequence (one new
        token, its last) speculates, and no further than its output, the context and the
        budget allow, so every kept token is one plain decoding could have produced."""
        drafts = seq.draft_token_ids
        if not drafts or num_new != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        return drafts[: min(self.draft_room(seq), budget - 1)]

    def draft_room(self, seq: Sequence) -> int:
        """The most drafts `seq` may verify in one step: its output and the context leave
        room for them and the target's own token."""
        return min(
            seq.sampling.max_tokens - seq.num_output_tokens - 1,
            self.max_seq_len - seq.num_tokens - 1,
        )

    def _ends_unresolved(self, seq: Sequence) -> bool:
        """Its unresolved tokens reach max_tokens or the longest sequence: it finishes
        with them, so another step would compute a token that is dropped."""
        if not seq.num_unresolved:
            return False
        num_output = seq.num_output_tokens + seq.num_unresolved
        return (
            num_output >= seq.sampling.max_tokens
            or seq.num_tokens + seq.num_unresolved >= self.max_seq_len
        )

    def _running_adapters(self) -> set[str]:
        """The distinct adapters of the running sequences (empty when LoRA is off)."""
        if self.config.max_loras is None:
            return set()
        return {seq.lora_name for seq in self.running if seq.lora_name is not None}

    def _adapter_fits(self, lora_name: str, adapters: set[str]) -> bool:
        """A sequence of `lora_name` may join the running `adapters` within `max_loras`."""
        limit = self.config.max_loras
        return limit is None or lora_name in adapters or len(adapters) < limit

    def _key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.by_priority else 0, seq.arrival_order)

    def _num_new_tokens(self, seq: Sequence, num_computed: int, budget: int) -> int:
        num_new = min(seq.num_tokens + seq.num_unresolved - num_computed, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, threshold) if threshold is not None else num_new

    def _emit(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        num_computed: int,
        num_new: int,
        drafts: list[int] | None = None,
    ) -> None:
        drafts = drafts or []
        will_sample = num_computed + num_new - len(drafts) == seq.num_tokens + seq.num_unresolved
        out.scheduled.append(
            ScheduledSequence(seq, num_computed, num_new, will_sample, list(drafts))
        )
        out.num_batched_tokens += num_new
        # Progress advances now, so a step scheduled before this one's `update` (async
        # scheduling) starts where this one ends.
        seq.num_computed_tokens = num_computed + num_new
        if will_sample:
            seq.num_unresolved += 1

    def _preempt(self, seq: Sequence) -> None:
        # Output tokens are kept: the recompute covers prompt + output, mostly from cache.
        self.kv.free(seq)
        self._left_running.append(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        bisect.insort(self.waiting, seq, key=self._key)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        sampling = seq.sampling
        # A stop token counts only after min_tokens others (the sampler masks them before
        # that; this is the worker's backstop).
        if seq.num_output_tokens > sampling.min_tokens:
            if not sampling.ignore_eos and token_id in self.eos_token_ids:
                seq.finish(FinishReason.STOP)
                return
            if token_id in sampling.stop_token_ids:
                seq.finish(FinishReason.STOP, stop_token_id=token_id)
                return
        if seq.num_output_tokens >= sampling.max_tokens or seq.num_tokens >= self.max_seq_len:
            seq.finish(FinishReason.LENGTH)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        del self.requests[seq.request_id]
