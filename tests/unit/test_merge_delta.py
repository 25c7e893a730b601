"""shared.protocol.merge_delta: the one rule both tiers coalesce a request's deltas by."""

from __future__ import annotations

from shared.protocol import RequestDelta, TokenLogprobs, merge_delta


def _logprob(value: float) -> TokenLogprobs:
    return TokenLogprobs(logprob=value, rank=1)


def test_tokens_and_logprobs_append_and_the_finish_wins() -> None:
    into = RequestDelta("r", [1], logprobs=[_logprob(-1.0)], num_cached_tokens=16)
    merge_delta(into, RequestDelta("r", [2], logprobs=[_logprob(-2.0)]))
    merge_delta(into, RequestDelta("r", [3], finish_reason="stop", stop_token_id=3))
    assert into.new_token_ids == [1, 2, 3]
    assert into.logprobs is not None
    assert [e.logprob for e in into.logprobs] == [-1.0, -2.0]
    assert (into.finish_reason, into.stop_token_id) == ("stop", 3)
    assert into.num_cached_tokens == 16


def test_queue_time_keeps_the_first_value_set() -> None:
    into = RequestDelta("r", [1])
    merge_delta(into, RequestDelta("r", [2], queue_time=0.5))
    merge_delta(into, RequestDelta("r", [3], queue_time=0.9))
    assert into.queue_time == 0.5
    first = RequestDelta("r", [1], queue_time=0.1)
    merge_delta(first, RequestDelta("r", [2], queue_time=0.7))
    assert first.queue_time == 0.1
