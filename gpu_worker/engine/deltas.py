"""What a step tells the wire: each changed sequence's `RequestDelta`, the sampled tokens'
logprobs, and the offline API's `Completion` that folds a request's deltas."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.core.sequence import FinishReason, Sequence
from gpu_worker.sampling.sampler import SamplerOutput
from shared.protocol import FinishReason as WireFinishReason
from shared.protocol import RequestDelta, TokenLogprobs

_WIRE_FINISH: dict[FinishReason, WireFinishReason] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


def request_delta(
    seq: Sequence,
    num_new: int,
    logprobs: dict[str, list[TokenLogprobs]],
    errors: dict[str, str],
) -> RequestDelta:
    """The wire delta of a sequence that got `num_new` tokens this step."""
    error = errors.get(seq.request_id)
    finish = _WIRE_FINISH[seq.finish_reason] if seq.finish_reason is not None else None
    # Gathered while the prompt ran; the first delta (this one, when set) takes them.
    state = seq.sampler_state
    prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
    return RequestDelta(
        request_id=seq.request_id,
        new_token_ids=seq.output_token_ids[-num_new:],
        finish_reason="error" if error is not None else finish,
        stop_token_id=seq.stop_token_id,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=logprobs.get(seq.request_id),
        error=error,
        # Only the first delta carries it: the render tier records it once per request.
        queue_time=seq.queue_time if seq.num_output_tokens == num_new else None,
        prompt_logprobs=prompt_logprobs,
    )


def sampled_logprobs(
    items: list[ScheduledSequence], result: SamplerOutput
) -> dict[str, list[TokenLogprobs]]:
    """The logprobs of each sampled item that asked for them (`result`'s tensors on the
    host already, or read here)."""
    if result.logprobs is None:
        return {}
    sampled = result.logprobs.tolist()
    ranks = result.ranks.tolist() if result.ranks is not None else [0] * len(sampled)
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    out: dict[str, list[TokenLogprobs]] = {}
    for row, item in enumerate(items):
        if item.seq.sampling.logprobs is None:
            continue
        k = result.num_top[row]
        out[item.seq.request_id] = [
            TokenLogprobs(
                logprob=sampled[row],
                rank=int(ranks[row]),
                top_token_ids=top_ids[row][:k] if top_ids is not None else [],
                top_logprobs=top_lps[row][:k] if top_lps is not None else [],
            )
        ]
    return out


@dataclass
class Completion:
    """One prompt's result from `Engine.generate`."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    stop_token_id: int | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        """Fold in one step's delta of this prompt."""
        self.token_ids.extend(delta.new_token_ids)
        if delta.logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_token_id = delta.stop_token_id
