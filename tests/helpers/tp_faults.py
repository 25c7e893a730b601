"""Followers that fail on purpose, for tests of how rank 0 reports a rank's failure.

A spawned rank runs a function it imports by name, so a test swaps
`tp_worker.follower_main` for one of these (importable from the child); each breaks one
real step of the follower's start-up and then runs the real `follower_main`.
"""

from __future__ import annotations

from typing import Any

from gpu_worker.core.config import EngineConfig
from gpu_worker.distributed.group import TPConfig
from gpu_worker.engine import rank, tp_worker

LOAD_ERROR = "injected: this rank cannot read the checkpoint"


def follower_failing_to_load(
    config: EngineConfig, tp_config: TPConfig, errors: tp_worker.ErrorQueue
) -> None:
    """`follower_main` whose model load raises `LOAD_ERROR` (after joining the group, as a
    missing or unreadable shard would)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(LOAD_ERROR)

    rank.load_model = refuse  # type: ignore[assignment]
    tp_worker.follower_main(config, tp_config, errors)
