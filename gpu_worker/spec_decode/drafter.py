"""What the engine asks of a model-free drafter, and the one place that picks it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.ngram import NgramProposer
from gpu_worker.spec_decode.suffix import SuffixProposer


class Drafter(Protocol):
    """Per-request drafting state, fed the tokens each request accepts.

    The engine calls `start_request` when a request is admitted, `add_tokens` with the
    tokens it accepts each step (in order, output only), `propose` before a verify step,
    and `finish_request` when it finishes or is aborted."""

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, k: int) -> list[int]:
        """At most k drafted tokens, possibly none; mutates nothing."""
        ...

    def finish_request(self, request_id: str) -> None: ...


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The model-free drafter of `config.method`; a draft model is the engine's to run."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"method {config.method!r} drafts with a model, not a model-free drafter")
