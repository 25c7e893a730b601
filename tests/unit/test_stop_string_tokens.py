"""A stop string ends the token ids, logprobs and usage where it ends the text: a worker delta
of several ids (a speculative step's accepted tokens, deltas merged while the consumer was
busy, a derender's whole output) gives exactly what the same ids one per delta give, the ids
up to and including the one whose text completed the stop string."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from render_server.generation import detokenizer
from render_server.generation.lifecycle import (
    ChoiceDelta,
    ChoiceSpec,
    Generation,
    PromptSpec,
)
from render_server.templating.tokenizer import Tokenizer
from render_server.worker_client.pool import RequestStream, WorkerPool
from shared.protocol import FinishReason, Generate, RequestDelta, TokenLogprobs
from shared.sampling import SamplingParams

PROSE = "The quick brown fox jumps over the lazy dog, then naps."
EMOJI = "ok 👍🏽 done and 日本語 end"
PROMPT = [504, 2365]
# Ids per delta: one at a time (the plain worker), fixed sizes, the whole output at once
# (a derender), and random sizes (seeds).
CHUNKINGS: list[int | str] = [2, 3, 5, "all", "seed0", "seed1", "seed2"]


@dataclass
class Outcome:
    """Everything a choice's client sees, streamed and whole."""

    streamed_text: str
    streamed_ids: list[int]
    streamed_logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    completion_tokens: int


def chunks(ids: list[int], chunking: int | str) -> Iterator[list[int]]:
    if chunking == "all":
        yield ids
        return
    rng = random.Random(chunking) if isinstance(chunking, str) else None
    i = 0
    while i < len(ids):
        size = rng.randint(1, 6) if rng is not None else int(chunking)
        yield ids[i : i + size]
        i += size


def logprobs_of(start: int, count: int) -> list[TokenLogprobs]:
    """One distinct entry per output position, so a misplaced cut shows."""
    return [TokenLogprobs(logprob=-0.5 * p, rank=p + 1) for p in range(start, start + count)]


def spec(stop: list[str], include: bool = False) -> ChoiceSpec:
    return ChoiceSpec(SamplingParams(max_tokens=64, logprobs=0), stop, include, True)


def worker_deltas(
    ids: list[int], chunking: int | str, finish: FinishReason = "length"
) -> list[RequestDelta]:
    """The deltas a worker sends for `ids`, the last one finishing."""
    deltas, done = [], 0
    for chunk in chunks(ids, chunking):
        deltas.append(RequestDelta("r-0", chunk, logprobs=logprobs_of(done, len(chunk))))
        done += len(chunk)
    deltas[-1].finish_reason = finish
    return deltas


def replayed(tokenizer: Tokenizer, choice_spec: ChoiceSpec, deltas: list[RequestDelta]) -> Outcome:
    """Feed the deltas to a choice with no worker (as a derender does), until it finishes."""
    generation = Generation(None, tokenizer, "r", [PromptSpec(PROMPT, [choice_spec])])
    [choice] = generation.choices
    outs: list[ChoiceDelta] = []
    for delta in deltas:
        if choice.finish_reason is not None:
            break  # a stop string ended it: later deltas are never read
        outs.append(choice.replay(delta))
    return outcome(generation, outs, 0, generation.usage().completion_tokens)


def outcome(
    generation: Generation, outs: list[ChoiceDelta], index: int, completion_tokens: int
) -> Outcome:
    choice = generation.choices[index]
    mine = [out for out in outs if out.index == index]
    last = mine[-1]
    return Outcome(
        "".join(out.text for out in mine),
        [i for out in mine for i in out.token_ids],
        [entry for out in mine for entry in out.logprobs or []],
        last.finish_reason,
        last.stop_reason,
        choice.text,
        list(choice.token_ids),
        choice.logprobs,
        completion_tokens,
    )


def one_per_delta(tokenizer: Tokenizer, choice_spec: ChoiceSpec, ids: list[int]) -> Outcome:
    return replayed(tokenizer, choice_spec, worker_deltas(ids, 1))


def first_ids_holding(tokenizer: Tokenizer, ids: list[int], stop: str) -> int:
    """How many ids it takes for the decoded text to contain `stop` (an oracle that does not
    run the detokenizer)."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], True))


CASES = [
    # (text, stop, include_stop_str_in_output, what the stop's end falls on)
    (PROSE, "jum", False),  # inside " jumps"
    (PROSE, " fox", False),  # a token boundary
    (PROSE, "brown fox ju", False),  # spans three tokens
    (PROSE, "lazy d", True),  # kept in the text
    (PROSE, " n", False),  # a whole token, the ids after it make a word with it
    (EMOJI, "ok", False),  # the next ids leave a character incomplete
    (EMOJI, "👍", False),  # completed by the third of its byte ids
    (EMOJI, "本", True),
]


@pytest.fixture(params=["decode_stream", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both decoder paths: tokenizers' DecodeStream and the pure-Python window (a chunk
    stepped again id by id rewinds either)."""
    if request.param == "decode_stream" and not detokenizer._HAS_DECODE_STREAM:
        pytest.skip("tokenizers has no DecodeStream with ids= prefill")
    monkeypatch.setattr(detokenizer, "_HAS_DECODE_STREAM", request.param == "decode_stream")
    return request.param


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize(("text", "stop", "include"), CASES)
def test_several_ids_per_delta_keep_what_one_per_delta_keeps(
    smollm2_tokenizer: Tokenizer,
    backend: str,
    text: str,
    stop: str,
    include: bool,
    chunking: int | str,
) -> None:
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    choice_spec = spec([stop], include)
    plain = one_per_delta(smollm2_tokenizer, choice_spec, ids)
    kept = first_ids_holding(smollm2_tokenizer, ids, stop)
    assert kept < len(ids)  # the case has ids after the stop to cut
    assert plain.token_ids == plain.streamed_ids == ids[:kept]
    assert plain.logprobs == plain.streamed_logprobs == logprobs_of(0, kept)
    assert (plain.finish_reason, plain.stop_reason) == ("stop", stop)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert plain.text == plain.streamed_text == text[:cut]

    assert replayed(smollm2_tokenizer, choice_spec, worker_deltas(ids, chunking)) == plain


@settings(max_examples=100)  # at the profile's deadline a test, 200 s at most
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40),
    data=st.data(),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_text_stops_and_chunks(
    smollm2_tokenizer: Tokenizer, text: str, data: st.DataObject, include: bool, seed: int
) -> None:
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assume(ids)  # a lone control character ("\x16") encodes to no ids: nothing to generate
    decoded = smollm2_tokenizer.decode(ids, True)
    spans = st.tuples(st.integers(0, len(decoded)), st.integers(1, 8))
    stops = [decoded[i : i + n] for i, n in data.draw(st.lists(spans, min_size=1, max_size=3))]
    choice_spec = spec(stops, include)
    plain = one_per_delta(smollm2_tokenizer, choice_spec, ids)
    chunked = replayed(smollm2_tokenizer, choice_spec, worker_deltas(ids, f"seed{seed}"))
    assert chunked == plain
    whole = replayed(smollm2_tokenizer, choice_spec, worker_deltas(ids, "all"))
    assert whole == plain


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_no_match_keeps_every_id(
    smollm2_tokenizer: Tokenizer, backend: str, chunking: int | str
) -> None:
    ids = smollm2_tokenizer.encode(EMOJI, add_special_tokens=False)
    choice_spec = spec(["zebra", "👎"])
    outcome = replayed(smollm2_tokenizer, choice_spec, worker_deltas(ids, chunking))
    assert outcome == one_per_delta(smollm2_tokenizer, choice_spec, ids)
    assert outcome.token_ids == ids
    assert outcome.completion_tokens == len(ids)
    assert (outcome.text, outcome.finish_reason) == (EMOJI, "length")


@pytest.mark.parametrize("chunking", [2, "all"])
def test_the_eos_after_a_stop_string_goes_with_the_ids_after_it(
    smollm2_tokenizer: Tokenizer, chunking: int | str
) -> None:
    """A last delta that ends on EOS: the stop string came first, so no EOS was generated."""
    eos = smollm2_tokenizer.eos_token_ids[0]
    ids = smollm2_tokenizer.encode(PROSE, add_special_tokens=False)
    choice_spec = spec([" dog"])
    speculative = replayed(
        smollm2_tokenizer, choice_spec, worker_deltas([*ids, eos], chunking, finish="stop")
    )
    assert speculative == one_per_delta(smollm2_tokenizer, choice_spec, ids)
    assert eos not in speculative.token_ids
    assert speculative.completion_tokens == first_ids_holding(smollm2_tokenizer, ids, " dog")


def test_a_stop_string_on_the_last_id_before_eos_keeps_the_ids_and_drops_the_eos(
    smollm2_tokenizer: Tokenizer,
) -> None:
    eos = smollm2_tokenizer.eos_token_ids[0]
    ids = smollm2_tokenizer.encode(PROSE, add_special_tokens=False)
    choice_spec = spec(["naps."])
    speculative = replayed(
        smollm2_tokenizer, choice_spec, worker_deltas([*ids, eos], "all", finish="stop")
    )
    assert speculative.token_ids == ids
    assert speculative.logprobs == logprobs_of(0, len(ids))
    assert (speculative.finish_reason, speculative.stop_reason) == ("stop", "naps.")


class _Link:
    address = "fake"

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Pool:
    def __init__(self) -> None:
        self.link = _Link()

    async def submit(self, request: Generate) -> RequestStream:
        return RequestStream(request, self.link)


def test_several_choices_from_worker_streams_count_each_choices_own_ids(
    smollm2_tokenizer: Tokenizer,
) -> None:
    """n=3 through worker streams: every delta of a choice arrives before it is read (one
    merged delta, as when the consumer is busy), the stream keeps every id received, and
    each choice's ids, logprobs and the request's usage end at its own stop string."""
    ids = smollm2_tokenizer.encode(PROSE, add_special_tokens=False)
    specs = [spec(["jum"]), spec(["zebra"]), spec(["brown fox ju"], include=True)]
    pool = _Pool()
    generation = Generation(
        cast(WorkerPool, pool), smollm2_tokenizer, "r", [PromptSpec(PROMPT, specs)]
    )

    async def run() -> list[ChoiceDelta]:
        await generation.start()
        for number, choice in enumerate(generation.choices):
            assert choice.stream is not None
            for delta in worker_deltas(ids, number + 2):
                choice.stream.push(delta)
        try:
            return [out async for out in generation.deltas()]
        finally:
            await generation.aclose()

    outs = asyncio.run(run())
    for index, choice_spec in enumerate(specs):
        expected = one_per_delta(smollm2_tokenizer, choice_spec, ids)
        got = outcome(generation, outs, index, expected.completion_tokens)  # usage: below
        assert got == expected, index
    assert [len(c.token_ids) for c in generation.choices] == [5, len(ids), 5]
    assert generation.usage().completion_tokens == 5 + len(ids) + 5


def test_an_eos_with_no_stop_string_stays_in_the_ids_not_the_text(
    smollm2_tokenizer: Tokenizer,
) -> None:
    eos = smollm2_tokenizer.eos_token_ids[0]
    ids = [*smollm2_tokenizer.encode(PROSE, add_special_tokens=False), eos]
    finished = replayed(smollm2_tokenizer, spec(["zebra"]), worker_deltas(ids, 3, finish="stop"))
    assert finished.token_ids == finished.streamed_ids == ids
    assert finished.logprobs == logprobs_of(0, len(ids))
    assert (finished.text, finished.finish_reason) == (PROSE, "stop")
