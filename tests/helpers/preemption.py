"""Counting the scheduler's preemptions, for tests whose load must cause some."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_worker.core.scheduler import Scheduler


def count_preemptions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests every Scheduler preempts from now on (until the test ends),
    in order; each preemption still runs as it would."""
    preemptions: list[str] = []
    preempt = Scheduler._preempt

    def counting_preempt(scheduler: Scheduler, seq: Any) -> None:
        preemptions.append(seq.request_id)
        preempt(scheduler, seq)

    monkeypatch.setattr(Scheduler, "_preempt", counting_preempt)
    return preemptions
