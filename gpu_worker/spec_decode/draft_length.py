"""How many drafts each request gets in a step: as many as pay for their rows.

A verify step computes one row per drafted token, and rows are not free: on a CPU a row
costs a good part of a one-token decode (a quantized matmul kernel reads the weights once
per tile of rows and computes each row), and past a tile's edge the cost jumps. A draft
pays when the tokens it is expected to add are worth more than the time its row adds.
So the engine asks this controller, request by request as it schedules a step, for each
request's draft limit, and tells it what every step cost and what every request accepted:

- `StepCosts` learns the seconds of a decode step by its number of rows (what the engine
  timed, smoothed). A row count never timed is estimated from its timed neighbours, and
  made a little cheaper than that estimate: the controller then tries it once and learns
  its true cost, instead of never trying the row counts between two it knows. A timing
  not renewed for a while is forgotten, so a count judged in a slow moment (the machine
  busy with something else) is tried again.
- A drafter that runs a model (draft_model) costs time of its own: its steps are timed
  too (`DraftStep`) and learned the same way, by the tokens each computed. A round runs
  one draft step per depth: the first computes, for every request given a draft, the
  tokens its draft cache lacks (`catch_up`: those kept since its last round) and the
  next ones a row per request drafting that deep. A model-free drafter has no steps, and
  its drafts cost their verify rows only.
- Each request's acceptance rate a (the chance that a draft passes, given the ones before
  it did) is counted over its own verifications, starting from the rate of all requests
  so far. k drafts are expected to give 1 + a + a^2 + ... + a^k tokens.
- Before the step is scheduled, the decoding requests' drafts are handed out one at a
  time, each to the request whose next draft is likeliest to be used, and the hand-out
  with the most expected tokens per second (the verify step's seconds plus the drafting
  round's) is kept.

A request whose drafts are rarely accepted, or a batch whose rows already fill the
step's cost, gets k = 0: speculation switches itself off where it does not pay, and
back on when the rates or the costs change. Exactness does not depend on any of this:
verification keeps the target's tokens whatever was drafted.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SMOOTHING = 0.25
"""Weight of a new observation in the moving averages (costs and acceptance counts)."""
UNTRIED_DISCOUNT = 0.85
"""An untimed row count is estimated at this share of its neighbours' interpolation."""
FORGET_AFTER = 256
"""A row count's timing is dropped after this many timed steps of other counts."""
PRIOR_TRIALS = 2.0
"""Weight, in drafts, of the all-requests acceptance rate in a new request's rate."""
PROBE_EVERY = 16
"""Steps a request waits without drafts before it is given one to test its rate again."""
PROBE_COST = 1.25
"""A probe is given only while its row (and its drafting) costs at most this share of the
step."""


class StepCosts:
    """Seconds of a decode step by its rows, learned from timed steps."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._rows: list[int] = []
        """The timed row counts, sorted."""
        self._last_timed: dict[int, int] = {}
        """Each count's latest timing, as a number of timings so far."""
        self._num_timings = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        previous = self._seconds.get(rows)
        if previous is None:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = previous + SMOOTHING * (seconds - previous)
        self._num_timings += 1
        self._last_timed[rows] = self._num_timings
        stale = [r for r, at in self._last_timed.items() if self._num_timings - at > FORGET_AFTER]
        for r in stale:
            del self._seconds[r], self._last_timed[r]
            self._rows.remove(r)

    def estimate(self, rows: int) -> float | None:
        """The expected seconds of a step of `rows` rows; None before any step was timed.
        Between two timed counts: their linear interpolation; past the largest: the slope
        of the two largest (one timed count: its cost per row, halved, a guess that the
        next timings correct). Untimed counts are discounted (`UNTRIED_DISCOUNT`)."""
        known = self._rows
        if not known:
            return None
        seconds = self._seconds.get(rows)
        if seconds is not None:
            return seconds
        at = bisect.bisect_left(known, rows)
        if at == 0:
            low, high = 0, known[0]
            low_s = 0.0
        elif at == len(known):
            high = known[-1]
            low = known[-2] if len(known) > 1 else 0
            low_s = self._seconds[low] if len(known) > 1 else self._seconds[high] / 2
        else:
            low, high = known[at - 1], known[at]
            low_s = self._seconds[low]
        high_s = self._seconds[high]
        slope = (high_s - low_s) / (high - low)
        return UNTRIED_DISCOUNT * max(high_s + slope * (rows - high), 0.0)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a request emits in expectation with k drafts accepted in turn at `rate`:
    the target's own token plus rate^j for each draft j that all before it passed."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass(frozen=True)
class DraftStep:
    """One step a drafter's model ran: the tokens it computed and the seconds it took."""

    num_tokens: int
    seconds: float


def no_catch_up(request_id: str) -> int:
    """A model-free drafter's catch-up: nothing to compute before drafting."""
    return 0


@dataclass
class _Acceptance:
    """A request's smoothed counts: drafts that passed out of drafts tested."""

    passed: float = 0.0
    tested: float = 0.0
    idle_steps: int = 0
    """Steps in a row planned without drafts."""


class DraftLengthController:
    """Each request's draft limit for the step about to be scheduled (module docstring)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.costs = StepCosts()
        """The target's decode steps, by rows."""
        self.draft_costs = StepCosts()
        """The drafter's model steps, by tokens computed; never timed for a model-free one."""
        self._requests: dict[str, _Acceptance] = {}
        self._overall = _Acceptance(passed=1.0, tested=2.0)
        """All requests' counts, smoothed: the starting point of a new request's rate."""

    def plan(
        self,
        request_ids: Sequence[str],
        other_rows: int = 0,
        catch_up: Callable[[str], int] = no_catch_up,
    ) -> dict[str, int]:
        """The draft limit of each decoding request of the coming step, `other_rows` rows
        besides theirs (prefill chunks); `catch_up` gives the tokens a draft model must
        compute for a request before its first draft. Drafts are handed out one at a time,
        each to the request whose next draft is likeliest to be used, and the step keeps
        the hand-out with the most expected tokens per estimated second (costs jump at a
        tile's edge, so it goes on past a worse one). Before any step was timed, every
        request gets K. A request left at 0 for `PROBE_EVERY` steps gets one draft when
        that costs at most `PROBE_COST` of the step: without it a rate learned in bad
        moments never recovers."""
        limits = dict.fromkeys(request_ids, 0)
        if not limits or self.num_speculative_tokens <= 0:
            return limits
        rows = len(limits) + other_rows
        if self.costs.estimate(rows) is None:
            return dict.fromkeys(request_ids, self.num_speculative_tokens)
        rates = {request_id: self.rate(request_id) for request_id in limits}
        # Max-heap of the next draft's chance of being used: rate^(k + 1).
        heap = [(-rate, request_id) for request_id, rate in rates.items() if rate > 0]
        heapq.heapify(heap)
        tokens = float(rows - other_rows)
        given: list[str] = []
        drafts = dict.fromkeys(limits, 0)
        drafting = _Round(self.draft_costs, self.num_speculative_tokens)
        best_value, best_count = self._value(tokens, rows, 0.0), 0
        while heap:
            chance, request_id = heapq.heappop(heap)
            tokens -= chance  # chances are stored negated for the max-heap
            rows += 1
            given.append(request_id)
            drafts[request_id] += 1
            depth = drafts[request_id]
            drafting.add(depth, max(catch_up(request_id), 1) if depth == 1 else 1)
            value = self._value(tokens, rows, drafting.seconds)
            if value > best_value:
                best_value, best_count = value, len(given)
            if depth < self.num_speculative_tokens:
                heapq.heappush(heap, (chance * rates[request_id], request_id))
        for request_id in given[:best_count]:
            limits[request_id] += 1
        self._probe(limits, len(limits) + other_rows + best_count, catch_up)
        return limits

    def _value(self, tokens: float, rows: int, drafting_seconds: float) -> float:
        seconds = self.costs.estimate(rows)
        if seconds is None:
            return 0.0
        seconds += drafting_seconds
        return tokens / seconds if seconds > 0 else 0.0

    def _probe(self, limits: dict[str, int], rows: int, catch_up: Callable[[str], int]) -> None:
        """Give a draft to each request idle for `PROBE_EVERY` steps, while that is cheap:
        its row, and a drafting step of its catch-up tokens (beside the plan's own)."""
        for request_id, limit in limits.items():
            counts = self._requests.setdefault(request_id, _Acceptance())
            if limit > 0:
                counts.idle_steps = 0
                continue
            counts.idle_steps += 1
            if counts.idle_steps < PROBE_EVERY:
                continue
            now, then = self.costs.estimate(rows), self.costs.estimate(rows + 1)
            if now is None or then is None:
                continue
            then += self.draft_costs.estimate(max(catch_up(request_id), 1)) or 0.0
            if then <= PROBE_COST * now:
                limits[request_id] = 1
                counts.idle_steps = 0
                rows += 1

    def rate(self, request_id: str) -> float:
        """The chance that one of the request's drafts passes, given the ones before did."""
        own = self._requests.get(request_id, _Acceptance())
        overall = self._overall
        prior = overall.passed / overall.tested if overall.tested > 0 else 0.5
        return (own.passed + PRIOR_TRIALS * prior) / (own.tested + PRIOR_TRIALS)

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """`num_accepted` of the request's `num_drafts` drafts passed: the accepted ones are
        passes, and the first rejection (when there was one) a failure; drafts after it
        were never tested."""
        if num_drafts <= 0:
            return
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)
        own = self._requests.setdefault(request_id, _Acceptance())
        for counts in (own, self._overall):
            counts.passed = (1 - SMOOTHING) * counts.passed + num_accepted
            counts.tested = (1 - SMOOTHING) * counts.tested + tested

    def step_timed(self, rows: int, seconds: float, drafting: Sequence[DraftStep] = ()) -> None:
        """A decode step (no prefill in it) of `rows` rows took `seconds`, end to end, of
        which the drafter's model ran `drafting`."""
        self.drafted(drafting)
        self.costs.observe(rows, seconds - sum(step.seconds for step in drafting))

    def drafted(self, drafting: Sequence[DraftStep]) -> None:
        """The drafter's model ran these steps (in a step whose own cost says nothing of a
        decode row's, or in one `step_timed` is told of)."""
        for step in drafting:
            self.draft_costs.observe(step.num_tokens, step.seconds)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


class _Round:
    """The estimated seconds of a draft model's round as drafts are handed out: one step
    per depth, of the tokens the requests drafting that deep compute in it."""

    def __init__(self, costs: StepCosts, depth: int) -> None:
        self._costs = costs
        self._tokens = [0] * (depth + 1)
        self.seconds = 0.0

    def add(self, depth: int, num_tokens: int) -> None:
        """A request drafts to `depth`, computing `num_tokens` in that depth's step."""
        before = self._tokens[depth]
        after = before + num_tokens
        self._tokens[depth] = after
        self.seconds += self._step_seconds(after) - self._step_seconds(before)

    def _step_seconds(self, num_tokens: int) -> float:
        if num_tokens == 0:
            return 0.0
        return self._costs.estimate(num_tokens) or 0.0
