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
- Each request's acceptance rate a (the chance that a draft passes, given the ones before
  it did) is counted over its own verifications, starting from the rate of all requests
  so far. k drafts are expected to give 1 + a + a^2 + ... + a^k tokens.
- The step's requests are visited in the scheduler's order; each gets the k that
  maximizes the step's expected tokens per second, counting the rows given out so far and
  one row for each request still to come.

A request whose drafts are rarely accepted, or a batch whose rows already fill the
step's cost, gets k = 0: speculation switches itself off where it does not pay, and
back on when the rates or the costs change. Exactness does not depend on any of this:
verification keeps the target's tokens whatever was drafted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

SMOOTHING = 0.25
"""Weight of a new observation in the moving averages (costs and acceptance counts)."""
UNTRIED_DISCOUNT = 0.85
"""An untimed row count is estimated at this share of its neighbours' interpolation."""
FORGET_AFTER = 256
"""A row count's timing is dropped after this many timed steps of other counts."""
PRIOR_TRIALS = 2.0
"""Weight, in drafts, of the all-requests acceptance rate in a new request's rate."""


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


@dataclass
class _Acceptance:
    """A request's smoothed counts: drafts that passed out of drafts tested."""

    passed: float = 0.0
    tested: float = 0.0


class DraftLengthController:
    """Each request's draft limit for the step being scheduled (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.costs = StepCosts()
        self._requests: dict[str, _Acceptance] = {}
        self._overall = _Acceptance(passed=1.0, tested=2.0)
        """All requests' counts, smoothed: the starting point of a new request's rate."""
        self._rows = 0
        self._tokens = 0.0
        self._to_come = 0

    def begin_step(self, num_requests: int) -> None:
        """A step is being scheduled over `num_requests` running requests."""
        self._rows, self._tokens, self._to_come = 0, 0.0, num_requests

    def limit(self, request_id: str, room: int) -> int:
        """The most drafts `request_id` may have this step (at most `room`); call `drafted`
        with what it got. Before any step was timed, the configured K."""
        self._to_come = max(self._to_come - 1, 0)
        most = min(self.num_speculative_tokens, room)
        if most <= 0 or self.costs.estimate(1) is None:
            return max(most, 0)
        rate = self.rate(request_id)
        best_k, best = 0, -1.0
        for k in range(most + 1):
            seconds = self.costs.estimate(self._rows + 1 + k + self._to_come)
            if seconds is None or seconds <= 0:
                return most
            value = (self._tokens + expected_tokens(rate, k) + self._to_come) / seconds
            if value > best:
                best_k, best = k, value
        return best_k

    def drafted(self, request_id: str, num_drafts: int) -> None:
        """`request_id` was scheduled this step with `num_drafts` drafts."""
        self._rows += 1 + num_drafts
        self._tokens += expected_tokens(self.rate(request_id), num_drafts)

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

    def step_timed(self, rows: int, seconds: float) -> None:
        """A decode step (no prefill in it) of `rows` rows took `seconds`, end to end."""
        self.costs.observe(rows, seconds)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
