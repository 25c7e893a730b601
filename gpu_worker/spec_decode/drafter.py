"""What the engine asks of a drafter, and the one place that picks a model-free one.

The model-free drafters (`ngram`, `suffix`) live in this package; the draft_model drafter
runs a second engine, so it lives beside the engine (`gpu_worker.engine.draft_model`),
which builds it and hands it to its `Speculator`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.draft_length import DraftStep
from gpu_worker.spec_decode.ngram import NgramProposer
from gpu_worker.spec_decode.suffix import SuffixProposer


class Drafter(Protocol):
    """Per-request drafting state, fed the tokens each request accepts.

    The engine's speculator calls `start_request` when a request is admitted, `add_tokens`
    with the tokens it accepts each step (in order, output only), `propose` for each
    decoding request before the step is scheduled, and `finish_request` when it finishes
    or is aborted. Before proposing, `expect` tells it how many drafts each request may be
    asked for (0 or absent: none), so a drafter that batches its work across requests (the
    draft model, at the step's first `propose`) drafts those and no more. A drafter that
    runs a model says what a round will compute (`catch_up_tokens`) and what its steps
    took (`take_steps`)."""

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, k: int) -> list[int]:
        """At most k drafted tokens, possibly none. Asking twice without new tokens gives
        the same drafts: no request's state changes (a draft model may fill its cache)."""
        ...

    def finish_request(self, request_id: str) -> None: ...

    def expect(self, limits: Mapping[str, int]) -> None:
        """The coming step's most drafts per request; a model-free drafter ignores it."""
        ...

    def catch_up_tokens(self, request_id: str) -> int:
        """Tokens the drafter's model must compute for the request before its first draft
        (kept since its cache last held them); 0 without a model."""
        ...

    def take_steps(self) -> list[DraftStep]:
        """The drafter's model steps since the last call, for the draft-length controller
        to weigh what drafting costs; none without a model."""
        ...


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The model-free drafter of `config.method`; a draft model's drafter is the engine's
    to build (`gpu_worker.engine.draft_model.build_draft_drafter`)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"method {config.method!r} drafts with a model, not a model-free drafter")
