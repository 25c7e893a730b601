"""Clocks and medians: how a benchmark times a call on a machine that may be shared."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    """Wall and process-CPU seconds. With one torch thread the CPU time does not grow when
    other jobs take the core away, so its ratio is the steadier one on a shared machine."""

    wall: float
    cpu: float

    @classmethod
    def now(cls) -> Clock:
        return cls(time.perf_counter(), time.process_time())

    @classmethod
    def measure(cls, fn: Callable[[], object]) -> Clock:
        """The clocks of one call of `fn`."""
        start = cls.now()
        fn()
        return cls.now() - start

    def __sub__(self, other: Clock) -> Clock:
        return Clock(self.wall - other.wall, self.cpu - other.cpu)


def timed(
    fn: Callable[[], object],
    repeats: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
    warmup: bool = True,
) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after one untimed call (first-call
    costs) unless not `warmup`."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def median_ms(
    fn: Callable[[], object],
    repeats: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
    warmup: bool = True,
) -> float:
    """The median call of `timed(fn, repeats)`, in milliseconds."""
    return statistics.median(timed(fn, repeats, clock=clock, warmup=warmup)) * 1e3


def median_ms_each(
    cases: dict[str, Callable[[], object]],
    rounds: int,
    *,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
    min_timing_s: float = 0.0,
    reverse: bool = True,
) -> dict[str, float]:
    """Each case's median call in milliseconds over `rounds` rounds that call every case in
    turn, so load drifting on a shared machine hits every case alike; with `reverse`, in
    reverse order every other round, so no case always follows the same one. `sync` waits
    for the device's work after each call; each timing loops enough calls to last at least
    `min_timing_s` (one call when 0)."""
    loops = dict.fromkeys(cases, 1)
    for name, fn in cases.items():  # warm up, and size the loops
        fn()
        if min_timing_s > 0:
            once = max(timed(fn, 1, clock=clock, warmup=False)[0], 1e-7)
            loops[name] = max(1, int(min_timing_s / once))
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases.items())
    for _ in range(rounds):
        for name, fn in order:
            start = clock()
            for _ in range(loops[name]):
                fn()
            sync()
            times[name].append((clock() - start) / loops[name])
        if reverse:
            order.reverse()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}
