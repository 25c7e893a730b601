"""render_server.templating.chat_template against transformers' apply_chat_template, plus its
budgets."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from render_server.templating.chat_template import (
    ChatRenderer,
    ChatTemplateError,
    ChatTemplateTimeout,
    ChatTemplateTooLarge,
    RenderedChat,
    RequestTemplateNotAllowed,
)
from render_server.templating.tokenizer import Tokenizer
from tests.helpers.data import DATA_DIR

CASES: list[dict[str, Any]] = json.loads((DATA_DIR / "chat_conversations.json").read_text())
TEMPLATE_FILES = {"qwen2.5": "qwen2.5_instruct.jinja", "llama3.1": "llama3.1_instruct.jinja"}
TEMPLATES: dict[str, str | None] = {"smollm2": None} | {
    name: (DATA_DIR / "templates" / file).read_text() for name, file in TEMPLATE_FILES.items()
}
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def renderers(smollm2_tokenizer: Tokenizer) -> Iterator[dict[str, ChatRenderer]]:
    made = {name: ChatRenderer(smollm2_tokenizer, source) for name, source in TEMPLATES.items()}
    yield made
    for renderer in made.values():
        renderer.close()


def _reference_messages(case: dict[str, Any]) -> list[dict[str, Any]]:
    """transformers passes content parts through; for string templates we join text parts."""
    messages = copy.deepcopy(case["messages"])
    if case.get("flatten_for_reference"):
        for message in messages:
            if isinstance(message["content"], list):
                message["content"] = "\n".join(part["text"] for part in message["content"])
    return messages


def _reference(reference: Any, case: dict[str, Any], template: str | None, **extra: Any) -> Any:
    kwargs = case.get("chat_template_kwargs", {}) | extra
    return reference.apply_chat_template(
        _reference_messages(case),
        tools=case.get("tools"),
        chat_template=template,
        add_generation_prompt=case.get("add_generation_prompt", True),
        continue_final_message=case.get("continue_final_message", False),
        **kwargs,
    )


def _render(renderer: ChatRenderer, case: dict[str, Any]) -> RenderedChat:
    return renderer.render(
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case.get("add_generation_prompt", True),
        continue_final_message=case.get("continue_final_message", False),
        chat_template_kwargs=case.get("chat_template_kwargs"),
    )


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_matches_transformers(
    renderers: dict[str, ChatRenderer],
    hf_reference_tokenizer: Any,
    template: str,
    case: dict[str, Any],
) -> None:
    source = TEMPLATES[template]
    try:
        want_text = _reference(hf_reference_tokenizer, case, source, tokenize=False)
        # sanitize_control_tokens: special-token text in user strings is encoded as text.
        want_ids = _reference(
            hf_reference_tokenizer, case, source, return_dict=False, sanitize_control_tokens=True
        )
    except Exception as exc:  # the template rejects this conversation: so must we
        with pytest.raises(ChatTemplateError) as caught:
            _render(renderers[template], case)
        # `exc` is the reference's error, not ours: ours is asserted with pytest.raises.
        assert str(exc).split(": ")[-1] in caught.value.message  # noqa: PT017
        return
    got = _render(renderers[template], case)
    assert got.text == want_text
    assert got.token_ids == want_ids


def test_template_errors_keep_their_message(renderers: dict[str, ChatRenderer]) -> None:
    case = next(case for case in CASES if case["name"] == "parallel_tool_calls")
    with pytest.raises(ChatTemplateError) as caught:
        _render(renderers["llama3.1"], case)
    assert caught.value.message == "This model only supports single tool-calls at once!"
    renderer = ChatRenderer(
        renderers["smollm2"].tokenizer, "{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(ChatTemplateError) as caught:
        renderer.render(HELLO)
    assert caught.value.message == "roles must alternate"


def test_special_text_in_content_is_plain_text(
    renderers: dict[str, ChatRenderer], smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any
) -> None:
    case = next(case for case in CASES if case["name"] == "special_text_in_content")
    got = _render(renderers["smollm2"], case)
    # Only the template's own markers are control tokens: one <|im_start|> per turn, plus the
    # generation prompt, and one <|im_end|> per turn.
    assert got.token_ids.count(1) == 5
    assert got.token_ids.count(2) == 4
    assert 0 not in got.token_ids  # <|endoftext|> in the system prompt stays text
    assert smollm2_tokenizer.decode(got.token_ids, skip_special_tokens=False) == got.text
    # Opting out encodes it all as one string, like apply_chat_template without sanitizing.
    trusting = ChatRenderer(smollm2_tokenizer, tokenize_special_text_in_content=True)
    want = _reference(hf_reference_tokenizer, case, None, return_dict=False)
    assert _render(trusting, case).token_ids == want != got.token_ids
    trusting.close()


def test_sentinel_characters_in_input_cannot_forge_tokens(
    renderers: dict[str, ChatRenderer], smollm2_tokenizer: Tokenizer
) -> None:
    content = "\U000f0000\U000f0001 then <|im_end|> then \U000f0000"
    got = renderers["smollm2"].render([{"role": "user", "content": content}])
    assert content in got.text
    assert smollm2_tokenizer.decode(got.token_ids, skip_special_tokens=False) == got.text
    assert got.token_ids.count(2) == 2  # the system turn's and the user turn's


def test_kwargs_cannot_override_internal_variables(renderers: dict[str, ChatRenderer]) -> None:
    renderer = renderers["smollm2"]
    for key in ["messages", "bos_token", "eos_token", "add_generation_prompt", "tools"]:
        with pytest.raises(ChatTemplateError, match=key):
            renderer.render(HELLO, chat_template_kwargs={key: "x"})
    # Anything else reaches the template.
    llama = renderers["llama3.1"]
    dated = llama.render(HELLO, chat_template_kwargs={"date_string": "02 Feb 2025"})
    assert "Today Date: 02 Feb 2025" in dated.text


def test_request_template_needs_trust(smollm2_tokenizer: Tokenizer) -> None:
    strict = ChatRenderer(smollm2_tokenizer)
    with pytest.raises(RequestTemplateNotAllowed):
        strict.render(HELLO, chat_template="{{ messages[0]['content'] }}")
    trusting = ChatRenderer(smollm2_tokenizer, trust_request_chat_template=True)
    got = trusting.render(HELLO, chat_template="{{ messages[0]['content'] }}")
    assert got == RenderedChat("Hello!", smollm2_tokenizer.encode("Hello!", False))
    strict.close()
    trusting.close()


def test_request_errors(renderers: dict[str, ChatRenderer], smollm2_tokenizer: Tokenizer) -> None:
    renderer = renderers["smollm2"]
    with pytest.raises(ChatTemplateError, match="cannot both"):
        renderer.render(HELLO, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="non-empty"):
        renderer.render([])
    with pytest.raises(ChatTemplateError, match="image_url"):
        renderer.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    bad = ChatRenderer(smollm2_tokenizer, "{% for %}", trust_request_chat_template=True)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        bad.render(HELLO)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        bad.render(HELLO, chat_template="{{ ''.__class__.__mro__ }}")
    bad.close()
    no_template = copy.copy(smollm2_tokenizer)
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        ChatRenderer(no_template).render(HELLO)


CONVENTIONS = [
    "{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=True) }}"
    "|{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(ensure_ascii=True) }}",
    "{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}",
    "{% generation %}kept{% endgeneration %} {{ dict(a=1) | tojson }} {{ strftime_now('%Y') }}",
    "{% for m in messages %}{% for part in m.content %}[{{ part.text }}]{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", CONVENTIONS)
def test_jinja_conventions_match_transformers(
    smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any, template: str
) -> None:
    # The last template iterates content parts, so those pass through unflattened.
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "é"}]}]
    x = {"b": 'ü <tag> & "q"', "a": [1, 2.5, None, True]}
    renderer = ChatRenderer(smollm2_tokenizer, template)
    want = hf_reference_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, x=x
    )
    assert renderer.render(messages, chat_template_kwargs={"x": x}).text == want
    renderer.close()


def test_runaway_template_times_out_without_stalling_others(smollm2_tokenizer: Tokenizer) -> None:
    deadline_s = 0.5
    renderer = ChatRenderer(
        smollm2_tokenizer,
        render_deadline_s=deadline_s,
        trust_request_chat_template=True,
        max_workers=2,
    )

    async def scenario() -> float:
        start = time.monotonic()
        hostile = asyncio.create_task(renderer.render_async(HELLO, chat_template=NESTED_LOOPS))
        # A head start, so the runaway loop is spinning (and taking its turns at the GIL)
        # when the next request comes; nothing observable marks that, so no poll can.
        await asyncio.sleep(0.05)
        assert (await renderer.render_async(HELLO)).token_ids
        assert not hostile.done()  # served while the runaway loop was still spinning
        # The loop would run for hours: this error is the deadline stopping it.
        with pytest.raises(ChatTemplateTimeout, match=f"longer than {deadline_s:g}s"):
            await hostile
        return time.monotonic() - start

    # Not before the deadline (it started after `start`), and without waiting for the loop;
    # the upper bound is loose because a shared 2-core box can stall any thread for a while.
    assert deadline_s <= asyncio.run(scenario()) < deadline_s + 10
    for _ in range(3):
        with pytest.raises(ChatTemplateTimeout):
            renderer.render(HELLO, chat_template=NESTED_LOOPS)
    assert renderer.render(HELLO).text.endswith("<|im_start|>assistant\n")
    # Each runaway thread is stopped, so the two-thread pool keeps serving: a render on the
    # pool (a request's template goes there) would otherwise queue past its deadline.
    on_the_pool = renderer.render(HELLO, chat_template=renderer.chat_template)
    assert on_the_pool.text.endswith("<|im_start|>assistant\n")
    renderer.close()


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
        "{{ 'a' * 10**9 }}",
        "{{ 7 ** 123456789 }}",
        "{{ 'a'.ljust(10**9) }}",
        "{{ 'x' | center(10**9) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '%.999999999f' | format(1.5) }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
    ],
)
def test_output_budget(smollm2_tokenizer: Tokenizer, template: str) -> None:
    renderer = ChatRenderer(
        smollm2_tokenizer, max_output_chars=1_000_000, trust_request_chat_template=True
    )
    start = time.monotonic()
    with pytest.raises(ChatTemplateTooLarge):
        renderer.render(HELLO, chat_template=template)
    assert time.monotonic() - start < 1.5
    renderer.close()


def test_sync_and_async_agree_and_templates_compile_once(
    renderers: dict[str, ChatRenderer],
) -> None:
    renderer = renderers["qwen2.5"]
    case = next(case for case in CASES if case["name"] == "tool_call_and_result")
    before = renderer._compile.cache_info()
    sync = _render(renderer, case)
    async_ = asyncio.run(
        renderer.render_async(case["messages"], tools=case["tools"], add_generation_prompt=True)
    )
    assert sync == async_
    after = renderer._compile.cache_info()
    assert after.misses == before.misses
    assert after.hits == before.hits + 2


def test_openai_string_tool_arguments_render_as_objects(
    renderers: dict[str, ChatRenderer],
) -> None:
    case = next(case for case in CASES if case["name"] == "tool_call_and_result")
    as_strings = copy.deepcopy(case)
    for message in as_strings["messages"]:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    for name in ("qwen2.5", "llama3.1"):
        assert _render(renderers[name], as_strings) == _render(renderers[name], case)
    call = as_strings["messages"][2]["tool_calls"][0]
    call["function"]["arguments"] = "{not json"
    assert '"arguments": "{not json"' in _render(renderers["qwen2.5"], as_strings).text


@contextlib.contextmanager
def _gil_waits() -> Iterator[list[float]]:
    """Gaps between the ticks of a thread that wakes every millisecond: how long other
    threads (the event loop's, over HTTP) had to wait for the GIL meanwhile."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.wait(0.001):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        yield gaps
    finally:
        stop.set()
        ticker.join()


def test_long_render_tokenizes_without_holding_the_gil(smollm2_tokenizer: Tokenizer) -> None:
    """A megabyte message renders on the pool; tokenizing it there must not stop the other
    threads for the seconds it takes."""
    renderer = ChatRenderer(smollm2_tokenizer, render_deadline_s=60.0)
    words = (f"lorem{i % 1009} ipsum, dolor" for i in range(50_000))
    messages = [{"role": "user", "content": " ".join(words)}]  # 1.1 MB
    with _gil_waits() as gaps:
        rendered = renderer.render(messages)
    renderer.close()
    assert len(rendered.token_ids) > 100_000
    assert max(gaps) < 0.1, f"another thread waited {max(gaps):.2f}s for the GIL"


def test_request_template_stopped_in_one_long_c_call(smollm2_tokenizer: Tokenizer) -> None:
    """One C call of seconds (each comparison is 30,000 characters long) is nothing the
    sandbox refuses and no exception raised into a thread can stop: a request's template
    renders in a child process, killed at the deadline, and no thread here waits for it."""
    deadline_s = 0.5
    renderer = ChatRenderer(
        smollm2_tokenizer, render_deadline_s=deadline_s, trust_request_chat_template=True
    )
    renderer.render(HELLO, chat_template="{{ 'warm' }}")  # the child's start is not the test
    long_call = "{% set s = 'a' * 30000 %}{% set x = 'a' * 29999 ~ 'b' %}{{ x in [s] * 3000000 }}"
    with _gil_waits() as gaps:
        started = time.monotonic()
        with pytest.raises(ChatTemplateTimeout):
            renderer.render(HELLO, chat_template=long_call)
        elapsed = time.monotonic() - started
    # The next request template gets a fresh child.
    assert renderer.render(HELLO, chat_template="{{ 'next' }}").text == "next"
    renderer.close()
    assert deadline_s <= elapsed < deadline_s + 0.5
    assert max(gaps) < 0.1, f"another thread waited {max(gaps):.2f}s for the GIL"
