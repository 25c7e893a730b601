"""The sampler's own per-request state, held by the engine's `Sequence`.

Torch-free to import, so that the sequence can carry it while the scheduler and the KV
manager still load without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpu_worker.sampling.structured import RequestMatcher
    from gpu_worker.sampling.token_filters import TokenFilter
    from shared.protocol import TokenLogprobs
    from shared.sampling import SamplingParams


@dataclass(eq=False)
class SamplerState:
    """What the sampler keeps for one request across steps. The request's params and
    tokens are not here: the sampler reads them from the sequence, their one owner."""

    matcher: RequestMatcher | None = field(default=None, repr=False)
    """The structured-output matcher of a constrained request; None for free ones."""
    token_filter: TokenFilter | None = field(default=None, repr=False)
    """Its allowed_token_ids and bad_words, prepared once; None when it has neither."""
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    """Prompt logprobs gathered chunk by chunk (index = prompt position), until the first
    delta carries them away; None when none were asked for or once they are sent."""


class SamplingRequest(Protocol):
    """One row of a step as the sampler and its penalties read it: the request's id, params
    and tokens (the engine's `Sequence` owns them) and the sampler's own state for it."""

    @property
    def request_id(self) -> str: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def output_position(self) -> int:
        """The output index of the token sampled now (tokens sampled by earlier steps that
        the host has not read yet count)."""
        ...

    @property
    def sampler_state(self) -> SamplerState: ...
