"""What a drafter without a model has nothing to do for in the `Drafter` protocol."""

from __future__ import annotations

from collections.abc import Mapping

from gpu_worker.spec_decode.draft_length import DraftStep


class ModelFreeDrafting:
    """A drafter that proposes when asked, from token statistics: no work to batch ahead
    of a step, no cache to catch up and no model steps whose time the draft-length
    controller would weigh."""

    def expect(self, limits: Mapping[str, int]) -> None:
        """Nothing to prepare: proposals are made when asked."""

    def catch_up_tokens(self, request_id: str) -> int:
        return 0

    def take_steps(self) -> list[DraftStep]:
        return []
