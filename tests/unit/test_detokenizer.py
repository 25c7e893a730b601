"""IncrementalDetokenizer on the real SmolLM2 tokenizer: streamed text equals the full decode,
split characters are held whole, and stop strings are cut exactly without ever leaking."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_server.generation import detokenizer
from render_server.generation.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from render_server.templating.tokenizer import Tokenizer
from tests.helpers.data import DATA_DIR

EXTRA = [
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # tabs\t\tand   spaces\n\n\n",
    "     leading and trailing whitespace runs      \r\n\r\n",
    "mixed <|im_start|>assistant\nhi<|im_end|> special text",
    "∀x∈ℝ: x² ≥ 0 — “quotes” ‘single’ … Ω≈ç√∫",
]
CORPUS: list[str] = [
    text
    for text in json.loads((DATA_DIR / "tokenizer_corpus.json").read_text(encoding="utf-8")) + EXTRA
    if "\ufffd" not in text and text
]


@pytest.fixture(params=["decode_stream", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both decoder paths: tokenizers' DecodeStream and the pure-Python window."""
    if request.param == "decode_stream" and not detokenizer._HAS_DECODE_STREAM:
        pytest.skip("tokenizers has no DecodeStream with ids= prefill")
    monkeypatch.setattr(detokenizer, "_HAS_DECODE_STREAM", request.param == "decode_stream")
    return request.param


def chunks(ids: list[int], rng: random.Random | None) -> Iterator[list[int]]:
    """One id at a time without an rng, else random chunk sizes 1..8."""
    i = 0
    while i < len(ids):
        size = rng.randint(1, 8) if rng else 1
        yield ids[i : i + size]
        i += size


def run(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> tuple[list[DetokenizerUpdate], str]:
    updates = [detok.add(chunk) for chunk in chunks(ids, rng)]
    return updates, detok.flush()


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_stream_equals_full_decode(
    smollm2_tokenizer: Tokenizer, backend: str, skip: bool, seed: int | None
) -> None:
    rng = random.Random(seed) if seed is not None else None
    for text in CORPUS:
        ids = encode(smollm2_tokenizer, text)
        detok = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=skip)
        updates, tail = run(detok, ids, rng)
        pieces = [u.text for u in updates] + [tail]
        assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip) == detok.output_text
        assert not any("\ufffd" in piece for piece in pieces), repr(text)
        assert not any(u.finished_by_stop for u in updates)


def test_special_tokens_skipped_or_kept(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    ids = encode(smollm2_tokenizer, "<|im_start|>assistant\nHi<|im_end|>")
    assert smollm2_tokenizer.id_to_token(ids[0]) == "<|im_start|>"
    for skip, want in [(True, "assistant\nHi"), (False, "<|im_start|>assistant\nHi<|im_end|>")]:
        detok = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=skip)
        run(detok, ids)
        assert detok.output_text == want


def test_split_character_is_held_until_complete(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    ids = encode(smollm2_tokenizer, "a👍")
    assert len(ids) >= 3  # the emoji's four bytes span several tokens
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    texts = [detok.add([i]).text for i in ids]
    assert texts[0] == "a"
    assert texts[-1] == "👍"
    assert not any(texts[1:-1])


@pytest.mark.parametrize("stops", [[], ["never"]])
def test_flush_drops_a_truncated_last_character(
    smollm2_tokenizer: Tokenizer, backend: str, stops: list[str]
) -> None:
    """A length cut inside a character: the text ends before it, never in U+FFFD."""
    for text in ["ok 世界", "a👍", "👨‍👩‍👧"]:
        whole = encode(smollm2_tokenizer, text)
        for cut in range(1, len(whole)):
            ids = whole[:cut]
            detok = IncrementalDetokenizer(smollm2_tokenizer, stop=stops)
            run(detok, ids)
            full = smollm2_tokenizer.decode(ids)
            assert detok.output_text == full.removesuffix("\ufffd"), (text, cut)
            assert detok.flush() == ""
            assert detok.add(encode(smollm2_tokenizer, "x")).text == ""


def test_flush_keeps_replacement_characters_that_are_not_a_cut(
    smollm2_tokenizer: Tokenizer, backend: str
) -> None:
    """U+FFFD the model wrote, or for bytes no later id could complete, stays: only an
    incomplete last character is dropped."""
    emoji = encode(smollm2_tokenizer, "👍")
    for ids in (
        encode(smollm2_tokenizer, "ok \ufffd"),
        [*encode(smollm2_tokenizer, "ok"), emoji[-1]],  # a continuation byte alone
    ):
        detok = IncrementalDetokenizer(smollm2_tokenizer)
        run(detok, ids)
        assert detok.output_text == smollm2_tokenizer.decode(ids)
        assert detok.output_text.endswith("\ufffd")


def test_prompt_gives_context_but_is_never_emitted(
    smollm2_tokenizer: Tokenizer, backend: str
) -> None:
    prompt = encode(
        smollm2_tokenizer, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    )
    generated = encode(smollm2_tokenizer, " Hi there 😀")
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_token_ids=prompt)
    run(detok, generated)
    assert detok.output_text == smollm2_tokenizer.decode(generated)
    # A prompt that ends inside a character must not crash or replay prompt text.
    emoji = encode(smollm2_tokenizer, "😀")
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_token_ids=prompt + emoji[:-1])
    run(detok, [emoji[-1], *encode(smollm2_tokenizer, " ok")])
    assert detok.output_text.endswith(" ok")
    assert "assistant" not in detok.output_text


def test_bad_ids_are_skipped(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    good = encode(smollm2_tokenizer, "still 👍 fine")
    bad = [-1, 2**40, smollm2_tokenizer.vocab_size + 7]
    mixed = [good[0], *bad, *good[1:3], bad[0], *good[3:]]
    for rng in (None, random.Random(3)):
        detok = IncrementalDetokenizer(smollm2_tokenizer)
        run(detok, mixed, rng)
        assert detok.output_text == smollm2_tokenizer.decode(good)


def stop_run(
    tok: Tokenizer, text: str, stop: list[str], rng: random.Random | None = None, **kwargs: bool
) -> tuple[IncrementalDetokenizer, list[DetokenizerUpdate], str]:
    """Stream `text` and check, at every update, that no stop text ever leaks."""
    detok = IncrementalDetokenizer(tok, stop=stop, **kwargs)
    updates: list[DetokenizerUpdate] = []
    for chunk in chunks(encode(tok, text), rng):
        updates.append(detok.add(chunk))
        body = detok.output_text
        if detok.stop_str and kwargs.get("include_stop_str_in_output"):
            assert body.endswith(detok.stop_str)
            body = body[: -len(detok.stop_str)]
        assert not any(s in body for s in stop), detok.output_text
    return detok, updates, detok.flush()


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_stop_spanning_tokens_is_cut_exactly(
    smollm2_tokenizer: Tokenizer, backend: str, seed: int | None
) -> None:
    rng = random.Random(seed) if seed is not None else None
    text = "The answer is 42. Done."
    detok, updates, tail = stop_run(smollm2_tokenizer, text, ["is 42"], rng)
    assert detok.output_text == "The answer "
    assert tail == ""
    assert [u.stop_str for u in updates if u.finished_by_stop] == ["is 42"]
    assert detok.stop_str == "is 42"
    assert updates[-1].text == ""
    detok, updates, _ = stop_run(
        smollm2_tokenizer, text, ["is 42"], rng, include_stop_str_in_output=True
    )
    assert detok.output_text == "The answer is 42"


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_first_completed_stop_wins(
    smollm2_tokenizer: Tokenizer, backend: str, seed: int | None
) -> None:
    rng = random.Random(seed) if seed is not None else None
    detok, _, _ = stop_run(smollm2_tokenizer, "The answer is 42. Done.", ["Done", "answer"], rng)
    assert (detok.output_text, detok.stop_str) == ("The ", "answer")
    # "bc" completes before "abcd" does, however the ids are chunked.
    detok, _, _ = stop_run(smollm2_tokenizer, "xabcdx", ["abcd", "bc"], rng)
    assert (detok.output_text, detok.stop_str) == ("xa", "bc")


def test_stop_at_very_start(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    detok, updates, tail = stop_run(smollm2_tokenizer, "STOP here", ["STOP"])
    assert updates[0] == DetokenizerUpdate("", "STOP", True)
    assert detok.output_text == tail == ""


def test_stop_prefix_that_diverges_is_released(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    detok, updates, tail = stop_run(smollm2_tokenizer, "Hello there", ["Hello world", "x"])
    assert [u.text for u in updates] == ["", "Hello there"]
    assert tail == ""
    # Held text that never diverges comes out at flush.
    detok, updates, tail = stop_run(smollm2_tokenizer, "Say Hello", ["Hello world"])
    assert [u.text for u in updates] == ["Say", " "]
    assert tail == "Hello"
    assert detok.output_text == "Say Hello"
    assert detok.stop_str is None


def test_special_token_text_as_stop(smollm2_tokenizer: Tokenizer, backend: str) -> None:
    ids = encode(smollm2_tokenizer, "Hi<|im_end|>more")
    for skip, want in [(False, "Hi"), (True, "Himore")]:
        detok = IncrementalDetokenizer(
            smollm2_tokenizer, skip_special_tokens=skip, stop=["<|im_end|>"]
        )
        run(detok, ids)
        assert detok.output_text == want


@pytest.mark.parametrize("seed", [0, 1])
def test_hold_back_is_bounded(smollm2_tokenizer: Tokenizer, backend: str, seed: int) -> None:
    rng = random.Random(seed)
    stops = ["\n\n\n\n\n\n\n\n\n\n", "zzzzzzzz", "    NOPE", "。。。。"]
    longest = max(map(len, stops))
    for text in CORPUS:
        ids = encode(smollm2_tokenizer, text)
        detok = IncrementalDetokenizer(smollm2_tokenizer, stop=stops)
        plain = IncrementalDetokenizer(smollm2_tokenizer)
        for chunk in chunks(ids, rng):
            detok.add(chunk)
            for token_id in chunk:  # with stops, a chunk's ids are stepped one at a time
                plain.add([token_id])
            # Stops hold back at most len-1 characters beyond what the decoder itself holds.
            if not detok.is_finished:
                lag = len(plain.output_text) - len(detok.output_text)
                assert 0 <= lag <= longest - 1
        detok.flush()
        if detok.stop_str is None:
            assert detok.output_text == smollm2_tokenizer.decode(ids)


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The first stop to complete in the full text (ties: earliest start), cut there."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60),
    data=st.data(),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_text_and_stops(
    smollm2_tokenizer: Tokenizer, text: str, data: st.DataObject, include: bool, seed: int
) -> None:
    ids = encode(smollm2_tokenizer, text)
    decoded = smollm2_tokenizer.decode(ids)
    spans = st.tuples(st.integers(0, len(decoded)), st.integers(1, 12))
    stops = [decoded[i : i + n] for i, n in data.draw(st.lists(spans, max_size=4))]
    stops += data.draw(st.lists(st.text(min_size=1, max_size=6), max_size=2))
    want, want_stop = reference(decoded, stops, include)
    for rng in (None, random.Random(seed)):
        detok = IncrementalDetokenizer(
            smollm2_tokenizer, stop=stops, include_stop_str_in_output=include
        )
        for chunk in chunks(ids, rng):
            update = detok.add(chunk)
            assert want.startswith(detok.output_text)
            assert update.finished_by_stop == (update.stop_str is not None)
        detok.flush()
        assert (detok.output_text, detok.stop_str) == (want, want_stop)
