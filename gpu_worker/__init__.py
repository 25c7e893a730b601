"""duet's GPU tier. `from gpu_worker import Engine` is the offline batch API.

Imports are lazy so the pure-Python parts (scheduler, kv_cache) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_worker.engine.engine import Completion, Engine

__all__ = ["Completion", "Engine"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from gpu_worker.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
