"""Chat templates: render a request's messages into prompt text and token ids.

Templates run in jinja2's immutable sandbox with transformers' conventions (trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, its `tojson`), so the text and
ids equal `tokenizer.apply_chat_template(..., tokenize=True)`. A template is code we did not
write, so each render runs under a deadline and an output budget; a render past its deadline
gets an exception raised into its thread and the request fails alone. Renders of the server's
own template with small inputs run in the calling thread (the event loop's, over HTTP), timed
by one watchdog thread; large inputs and request-supplied templates run on a small pool, the
latter rendered by a child process that is killed at the deadline. The sandbox lives in
sandbox.py, the deadline machinery in deadline.py, the child processes in isolation.py; what
a template is given is shaped in chat_inputs.py, and special-token text in the request is
kept plain by special_text.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2

from render_server.templating.chat_inputs import (
    cut_after_final_message,
    fits_inline,
    has_tool_turns,
    iterates_content,
    plain,
    prepare_messages,
    tag_final_message,
)
from render_server.templating.deadline import RenderInterrupted, RenderJob, Watchdog
from render_server.templating.errors import (
    ChatTemplateError,
    ChatTemplateTimeout,
    ChatTemplateTooLarge,
    RequestTemplateNotAllowed,
)
from render_server.templating.isolation import TemplateProcesses
from render_server.templating.sandbox import SandboxEnvironment
from render_server.templating.special_text import SpecialTextGuard, encode_restored
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
        self._special_text = (
            None
            if tokenize_special_text_in_content
            else SpecialTextGuard.for_tokens(tokenizer.special_tokens)
        )
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
            and (tools or has_tool_turns(messages))
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
        inline = chat_template is None and fits_inline(
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
        return self._env.compile_template(ast), iterates_content(ast)

    def _content_parts_uncached(self, source: str) -> bool:
        return iterates_content(self._env.parse_template(source))

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
        chat = prepare_messages(messages, content_parts)
        tools, documents, kwargs = plain(tools), plain(documents), plain(kwargs)
        by_sentinel: dict[str, str] = {}
        if self._special_text is not None:
            (chat, tools, documents, kwargs), by_sentinel = self._special_text.protect(
                (chat, tools, documents, kwargs)
            )
        final_text = tag_final_message(chat) if continue_final_message else None
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
            text = cut_after_final_message(text, final_text)
        return self._tokenize(text, by_sentinel)

    def _tokenize(self, text: str, by_sentinel: dict[str, str]) -> RenderedChat:
        if not by_sentinel:
            # Nothing protected: one encode of the whole text, exactly as transformers does.
            return RenderedChat(text, self.tokenizer.encode_text(text))
        return RenderedChat(*encode_restored(self.tokenizer, text, by_sentinel))
