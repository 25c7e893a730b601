"""What a step's model work hands back to the scheduler, as vLLM v1's `ModelRunnerOutput`.

Torch-free: the scheduler takes it in `update`. Sampling and verification fill it once
the step's tokens are on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import TokenLogprobs


@dataclass
class ModelRunnerOutput:
    """One step's new tokens per request, in the step's batch order."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> its tokens of this step: the one sampled token, or for a request with
    drafts the accepted drafts and then the target's token (verification's result). A
    request whose scheduled tokens did not reach its end (a prefill chunk) is absent."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """The logprobs of each token in `sampled_token_ids`, for the requests that asked."""
