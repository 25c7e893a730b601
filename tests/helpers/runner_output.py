"""A `ModelRunnerOutput` from the tokens a test decides each request sampled."""

from __future__ import annotations

from collections.abc import Mapping

from gpu_worker.core.outputs import ModelRunnerOutput


def runner_output(tokens: Mapping[str, int | list[int]]) -> ModelRunnerOutput:
    """One token per request (an int), or the tokens a drafted one kept (a list)."""
    return ModelRunnerOutput(
        sampled_token_ids={
            request_id: [value] if isinstance(value, int) else list(value)
            for request_id, value in tokens.items()
        }
    )
