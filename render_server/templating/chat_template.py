"""Chat templates: render a request's messages into prompt text and token ids.

Templates run in jinja2's immutable sandbox with transformers' conventions (trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, its `tojson`), so the text and
ids equal `tokenizer.apply_chat_template(..., tokenize=True)`. A template is code we did not
write, so each render runs under a deadline and an output budget; a render past its deadline
gets an exception raised into its thread and the request fails alone. Renders of the server's
own template with small inputs run in the calling thread (the event loop's, over HTTP), timed
by one watchdog thread; large inputs and request-supplied templates run on a small pool, the
latter rendered by a child process that is killed at the deadline. The sandbox lives in
sandbox.py, the deadline machinery in deadline.py, the child processes in isolation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from render_server.templating.deadline import RenderInterrupted, RenderJob, Watchdog
from render_server.templating.errors import (
    ChatTemplateError,
    ChatTemplateTimeout,
    ChatTemplateTooLarge,
    RequestTemplateNotAllowed,
)
from render_server.templating.isolation import TemplateProcesses
from render_server.templating.sandbox import SandboxEnvironment
from render_server.templating.templates import tools_template_for
from render_server.templating.tokenizer import Tokenizer

__all__ = [
    "ChatRenderer",
    "ChatTemplateError",
    "ChatTemplateTimeout",
    "ChatTemplateTooLarge",
    "RenderedChat",
    "RequestTemplateNotAllowed",
]

# A request's chat_template_kwargs may not replace any of these.
# fmt: off
RESERVED_TEMPLATE_VARS = frozenset({
    # what the server passes to every template
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "bos_token", "eos_token", "unk_token", "pad_token",
    # the environment's globals
    "raise_exception", "strftime_now", "namespace", "dict", "range", "lipsum", "cycler", "joiner",
})
# fmt: on
# Special-token text in user strings is swapped for one private-use character each while the
# template runs (Supplementary Private Use Area-A), then encoded as plain text.
_SENTINEL_FIRST, _SENTINEL_LAST = 0xF0000, 0xFFFFD
_SENTINEL_CLASS = "[\U000f0000-\U000ffffd]"
_SENTINEL_SPLIT = re.compile(f"({_SENTINEL_CLASS})")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, so the cut matches
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Inputs up to this many characters (strings plus one per value) render in the caller's
# thread: a few milliseconds at worst (tokenizing new text is most of it), where a hop to
# the pool and back costs a busy event loop far more per request than a short render
# (the GIL handoff). Larger ones go to the pool so they never hold up the loop.
_INLINE_MAX_CHARS = 8192


@dataclass(frozen=True)
class RenderedChat:
    """The prompt as text and as the token ids sent to a worker."""

    text: str
    token_ids: list[int]


def _mentions_content(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    kinds = (jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Name)
    for n in [node, *node.find_all(kinds)]:
        key = getattr(n.arg, "value", None) if isinstance(n, jinja2.nodes.Getitem) else None
        key = getattr(n, "attr", key)
        if key == "content" or (isinstance(n, jinja2.nodes.Name) and n.name in aliases):
            return True
    return False


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over message content, i.e. takes OpenAI-style content parts.
    Templates that only concatenate content get the text parts joined into a string instead."""
    aliases: set[str] = set()
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _mentions_content(assign.node, set()):
            aliases.add(assign.target.name)
    return any(_mentions_content(loop.iter, aliases) for loop in ast.find_all(jinja2.nodes.For))


_PLAIN_SCALARS = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    """Rebuild request data from plain JSON types, so no object with methods reaches a template."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    if kind is dict:  # the common case, ahead of the slower ABC checks below
        return {_plain(key): _plain(item) for key, item in value.items()}
    if kind is list:
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def _any_string_matches(values: Iterable[Any], matches: Callable[[str], bool]) -> bool:
    """Whether any string value (not dict keys, as in `_map_strings`) of plain request
    data `matches`."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            if matches(value):
                return True
        elif kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
    return False


def _fits_inline(values: Iterable[Any], budget: int) -> bool:
    """Whether the request data holds at most `budget` characters (strings, keys included,
    plus one per value); stops counting as soon as it is over."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            budget -= len(value)
        elif kind is dict or (kind is not list and isinstance(value, Mapping)):
            budget -= len(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif kind is list or isinstance(value, list | tuple):
            budget -= len(value)
            stack.extend(value)
        elif isinstance(value, str):
            budget -= len(value)
        if budget < 0:
            return False
    return True


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply `fn` to every string value (not dict keys) in plain request data."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, fn) for item in value]
    return value


def _has_tool_turns(messages: Any) -> bool:
    """Whether a chat holds tool calls or tool results, which only a template that shows
    tools renders faithfully."""
    return isinstance(messages, list) and any(
        isinstance(message, Mapping)
        and (message.get("role") == "tool" or message.get("tool_calls"))
        for message in messages
    )


def _flatten_content(content: list[Any]) -> str:
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content parts of type {kind!r} are not supported")
    return "\n".join(texts)


def _parse_tool_arguments(message: dict[str, Any]) -> None:
    """OpenAI sends tool-call arguments as a JSON string; HF templates expect the object
    (they `tojson` it), so a string that parses to an object is replaced by it, as vLLM does."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue  # malformed model output: render it as the string it is
            if isinstance(parsed, dict):
                function["arguments"] = parsed


def _prepare_messages(messages: Any, content_parts: bool) -> list[dict[str, Any]]:
    """transformers' normalization (drop None values, alias reasoning fields), then the
    OpenAI-to-HF fixes: tool-call arguments as objects, and text parts joined into a string
    for templates that treat content as a string."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    prepared = []
    for message in messages:
        if type(message) is not dict and not isinstance(message, Mapping):
            raise ChatTemplateError("each message must be an object")
        message = {
            _plain(key): _plain(value) for key, value in message.items() if value is not None
        }
        reasoning = None
        for field in _REASONING_FIELDS:
            if field in message:
                reasoning = message[field]
                break
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if not content_parts and type(message.get("content")) is list:
            message["content"] = _flatten_content(message["content"])
        if message.get("tool_calls"):
            _parse_tool_arguments(message)
        prepared.append(message)
    return prepared


class ChatRenderer:
    """Renders chat requests for one tokenizer: picks the template (request, `--chat-template`
    override, or the model's own), renders it in the sandbox under the deadline and output
    budget, and tokenizes the result the way `apply_chat_template(tokenize=True)` does.

    The server's own template renders in the caller's thread when the input is small (at most
    `inline_max_chars`); request templates and large inputs render on the pool, request
    templates by a child process. Either way the deadline interrupts the render."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template_override: str | None = None,
        *,
        render_deadline_s: float = 2.0,
        max_output_chars: int = 4_000_000,
        trust_request_chat_template: bool = False,
        tokenize_special_text_in_content: bool = False,
        max_workers: int = 4,
        template_cache_size: int = 32,
        inline_max_chars: int = _INLINE_MAX_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = template_override or tokenizer.chat_template
        self.tools_template = None if template_override else tools_template_for(self.chat_template)
        """duet's template that shows tools, for tool requests that ask for it when the
        model's own template cannot show them (None: the chat template shows them)."""
        self.render_deadline_s = render_deadline_s
        self.max_output_chars = max_output_chars
        self.trust_request_chat_template = trust_request_chat_template
        self.inline_max_chars = inline_max_chars
        self._env = SandboxEnvironment(max_output_chars)
        self._compile = functools.lru_cache(maxsize=template_cache_size)(self._compile_uncached)
        self._content_parts = functools.lru_cache(maxsize=template_cache_size)(
            self._content_parts_uncached
        )
        # Request templates render in processes that can be killed (isolation.py says why).
        self._processes = (
            TemplateProcesses(max_output_chars) if trust_request_chat_template else None
        )
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="chat-render")
        self._watchdog = Watchdog(render_deadline_s)
        named = [("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token)]
        named += [("unk_token", tokenizer.unk_token), ("pad_token", tokenizer.pad_token)]
        self._token_vars = {name: token for name, token in named if token is not None}
        # Whitespace tokens (Gemma's "\n") are ordinary text in any template; never protect them.
        protected = [t for t in tokenizer.special_tokens if t.strip()]
        self._protect_re: re.Pattern[str] | None = None
        self._protect_hint: re.Pattern[str] | None = None
        if protected and not tokenize_special_text_in_content:
            alternatives = "|".join(map(re.escape, sorted(protected, key=len, reverse=True)))
            # User text that already holds sentinel characters is protected too, as itself.
            self._protect_re = re.compile(f"{alternatives}|{_SENTINEL_CLASS}")
            # Any match starts with one of these characters. A one-class pattern scans fast,
            # where the alternation above tries every token at every position.
            first_chars = "".join(sorted({re.escape(token[0]) for token in protected}))
            self._protect_hint = re.compile(f"[{first_chars}\U000f0000-\U000ffffd]")
        for template in (self.chat_template, self.tools_template):
            if template is not None:
                # Compiled now rather than in the first request; a broken one fails per request.
                with contextlib.suppress(ChatTemplateError):
                    self._compile(template)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._watchdog.close()
        if self._processes is not None:
            self._processes.close()

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        with_tools_template: bool = False,
    ) -> RenderedChat:
        """Render (inline or on the pool) and wait; raises ChatTemplateTimeout past the deadline.
        `with_tools_template`: a chat with tools or tool turns renders with `tools_template`."""
        call, inline = self._plan(
            messages, add_generation_prompt, continue_final_message, tools, documents,
            chat_template_kwargs, chat_template, with_tools_template,
        )  # fmt: skip
        if inline:
            return self._render_inline(call)
        job = self._submit(call)
        assert job.future is not None
        try:
            return job.future.result(timeout=self.render_deadline_s)
        except TimeoutError:
            job.abort()
            raise self._timeout() from None

    async def render_async(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        with_tools_template: bool = False,
    ) -> RenderedChat:
        """`render` for the event loop: small renders of the server's template run inline (a
        few milliseconds at most, stopped at the deadline all the same); the rest run on the
        pool without blocking the loop, and a cancelled caller stops them too."""
        call, inline = self._plan(
            messages, add_generation_prompt, continue_final_message, tools, documents,
            chat_template_kwargs, chat_template, with_tools_template,
        )  # fmt: skip
        if inline:
            return self._render_inline(call)
        job = self._submit(call)
        assert job.future is not None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job.future), self.render_deadline_s)
        except TimeoutError:
            job.abort()
            raise self._timeout() from None
        except asyncio.CancelledError:
            job.abort()
            raise

    def _timeout(self) -> ChatTemplateTimeout:
        return ChatTemplateTimeout(
            f"chat template rendering took longer than {self.render_deadline_s:g}s"
        )

    def _plan(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        documents: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        chat_template: str | None,
        with_tools_template: bool,
    ) -> tuple[Callable[[], RenderedChat], bool]:
        """The render as a call, and whether it may run in the caller's thread."""
        # The cheap checks run in the caller, so they fail fast and never queue.
        if chat_template is not None and not self.trust_request_chat_template:
            raise RequestTemplateNotAllowed(
                "this server does not accept chat_template in requests "
                "(start it with --trust-request-chat-template to allow them)"
            )
        source = chat_template if chat_template is not None else self.chat_template
        if (
            chat_template is None
            and with_tools_template
            and self.tools_template is not None
            and (tools or _has_tool_turns(messages))
        ):
            source = self.tools_template
        if source is None:
            raise ChatTemplateError(
                "the model has no chat template; start the server with --chat-template FILE"
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set"
            )
        kwargs = dict(chat_template_kwargs or {})
        overridden = sorted(str(key) for key in kwargs if key in RESERVED_TEMPLATE_VARS)
        if overridden or not all(isinstance(key, str) for key in kwargs):
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {', '.join(overridden) or 'non-string keys'}"
            )
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not all(isinstance(item, Mapping) for item in value):
                raise ChatTemplateError(f"{name} must be a list of objects")
        call = functools.partial(
            self._render_now, source, chat_template is not None, messages,
            add_generation_prompt, continue_final_message, tools, documents, kwargs,
        )  # fmt: skip
        inline = chat_template is None and _fits_inline(
            (messages, tools, documents, kwargs), self.inline_max_chars
        )
        return call, inline

    def _submit(self, call: Callable[[], RenderedChat]) -> RenderJob:
        job = RenderJob(call)
        job.future = self._executor.submit(job.run)
        return job

    def _render_inline(self, call: Callable[[], RenderedChat]) -> RenderedChat:
        # The interrupt can fire anywhere from the moment `arm` queues the render (even
        # before `arm` returns) until `finish` takes the watchdog's lock; all of that is
        # inside this `try`, so it always becomes a ChatTemplateTimeout.
        try:
            render = self._watchdog.arm()
            try:
                return call()
            finally:
                self._watchdog.finish(render)
        except RenderInterrupted:
            raise self._timeout() from None

    def _compile_uncached(self, source: str) -> tuple[jinja2.Template, bool]:
        ast = self._env.parse_template(source)
        return self._env.compile_template(ast), _iterates_content(ast)

    def _content_parts_uncached(self, source: str) -> bool:
        return _iterates_content(self._env.parse_template(source))

    def _render_now(
        self,
        source: str,
        from_request: bool,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        documents: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> RenderedChat:
        deadline = time.monotonic() + self.render_deadline_s
        if from_request:  # parsed here for its syntax and shape, compiled in the child
            template, content_parts = None, self._content_parts(source)
        else:
            template, content_parts = self._compile(source)
        chat = _prepare_messages(messages, content_parts)
        tools, documents, kwargs = _plain(tools), _plain(documents), _plain(kwargs)
        by_sentinel: dict[str, str] = {}
        if self._protect_re is not None and _any_string_matches(
            (chat, tools, documents, kwargs), self._needs_protection
        ):
            (chat, tools, documents, kwargs), by_sentinel = _protect(
                (chat, tools, documents, kwargs), self._protect_re
            )
        final_text = _tag_final_message(chat) if continue_final_message else None
        context = {**self._token_vars, **kwargs, "messages": chat, "tools": tools}
        context.update(documents=documents, add_generation_prompt=add_generation_prompt)
        if template is not None:
            text = self._env.generate_text(template, context)
        else:
            assert self._processes is not None  # `_plan` let a request template through
            try:
                text = self._processes.render(source, context, deadline)
            except ChatTemplateTimeout:  # one message, whichever side saw the deadline first
                raise self._timeout() from None
        if final_text is not None:
            text = _cut_after_final_message(text, final_text)
        return self._tokenize(text, by_sentinel)

    def _needs_protection(self, text: str) -> bool:
        assert self._protect_hint is not None and self._protect_re is not None
        return self._protect_hint.search(text) is not None and (
            self._protect_re.search(text) is not None
        )

    def _tokenize(self, text: str, by_sentinel: dict[str, str]) -> RenderedChat:
        tokenizer = self.tokenizer
        if not by_sentinel:
            # Nothing protected: one encode of the whole text, exactly as transformers does.
            return RenderedChat(text, tokenizer.encode_text(text))
        pieces, token_ids = [], []
        for index, piece in enumerate(_SENTINEL_SPLIT.split(text)):
            original = by_sentinel.get(piece) if index % 2 else None
            if original is not None:
                pieces.append(original)
                token_ids += tokenizer.encode_plain(original)
            elif piece:
                pieces.append(piece)
                token_ids += tokenizer.encode_text(piece)
        return RenderedChat("".join(pieces), token_ids)


def _protect(
    values: tuple[Any, ...], pattern: re.Pattern[str]
) -> tuple[tuple[Any, ...], dict[str, str]]:
    """Swap each special-token text in the strings of `values` for a sentinel character;
    returns the new values and sentinel -> original text."""
    sentinels: dict[str, str] = {}

    def sentinel(match: re.Match[str]) -> str:
        text = match.group()
        if text not in sentinels:
            if _SENTINEL_FIRST + len(sentinels) > _SENTINEL_LAST:
                raise ChatTemplateError("too many distinct special tokens in the request")
            sentinels[text] = chr(_SENTINEL_FIRST + len(sentinels))
        return sentinels[text]

    marked = tuple(
        _map_strings(value, lambda text: pattern.sub(sentinel, text)) for value in values
    )
    return marked, {mark: text for text, mark in sentinels.items()}


def _tag_final_message(chat: list[dict[str, Any]]) -> str:
    """Append transformers' marker to the final message's text; returns that text."""
    content = chat[-1].get("content")
    if isinstance(content, str):
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
    raise ChatTemplateError("continue_final_message needs a final message with text content")


def _cut_after_final_message(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final message as given"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message, so trim our cut the same way
