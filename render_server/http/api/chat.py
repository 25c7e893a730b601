"""POST /v1/chat/completions: render the chat, generate on the workers, answer as OpenAI."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.generation.sampling_params import with_special_tokens
from render_server.generation.structured import check_constraint, resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import (
    admit,
    constraint_validator,
    hold_for_reasoning,
    new_generation,
    respond,
)
from render_server.http.formatter import OpenAIFormatter, TokenLookup
from render_server.http.serving import GENERATION_ERRORS, new_request_id, sse_event, usage_of
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.parsing.tool_choice import ToolPlan, plan_tools
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import ChatCompletionRequest
from render_server.schemas.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatChunkChoiceWithIds,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionFirstChunk,
    ChatDelta,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from render_server.schemas.responses import FinishReason as ApiFinishReason
from render_server.templating.chat_template import ChatTemplateError, RequestTemplateNotAllowed
from shared.protocol import Constraint, FinishReason, TokenLogprobs

router = APIRouter(tags=["generation"])


def _chat_logprobs(
    lookup: TokenLookup, token_ids: list[int], entries: list[TokenLogprobs] | None, top: int
) -> ChatChoiceLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text, raw = lookup(token_id)
        alternatives = []
        for alt_id, alt_logprob in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False):
            alt_text, alt_raw = lookup(alt_id)
            alternatives.append(TopLogprob(alt_text, alt_logprob, alt_raw))
        content.append(ChatTokenLogprob(text, entry.logprob, raw, alternatives))
    return ChatChoiceLogprobs(content)


async def _render(
    state: RenderState,
    body: ChatCompletionRequest,
    tools: list[dict] | None,
    with_tools_template: bool,
) -> list[int]:
    started = time.perf_counter()
    try:
        rendered = await state.renderer.render_async(
            [message.to_template_dict() for message in body.messages],
            tools=tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
            with_tools_template=with_tools_template,
        )
    except RequestTemplateNotAllowed as exc:
        raise ApiError(400, exc.message, param="chat_template") from exc
    except ChatTemplateError as exc:
        raise ApiError(400, exc.message, param="messages", code="chat_template_error") from exc
    finally:
        state.metrics.render_seconds.observe(time.perf_counter() - started)
    if body.add_special_tokens:
        return with_special_tokens(state.tokenizer, rendered.token_ids)
    return rendered.token_ids


async def _constraint(
    request: Request,
    state: RenderState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
) -> Constraint | None:
    """The request's structured-output constraint, or the tool choice's."""
    constraint = await resolve_constraint(constraint_validator(request, state.tokenizer), body)
    if plan.constraint is not None:
        if constraint is not None:
            raise ApiError(
                400,
                'tool_choice "required" or a named function cannot be combined with '
                "another structured-output constraint.",
                param="tool_choice",
            )
        constraint = await check_constraint(
            constraint_validator(request, state.tokenizer), plan.constraint, "tools"
        )
    return constraint


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat body becomes before anything runs: shared by /v1/chat/completions and
    its render (http/api/render.py), so both send a worker the same thing."""

    plan: ToolPlan
    thinking: bool
    """The template renders the model's reasoning (chat_template_kwargs.enable_thinking)."""
    constraint: Constraint | None
    prompt_ids: list[int]


async def prepare_chat(
    request: Request, state: RenderState, body: ChatCompletionRequest
) -> ChatPrompt:
    """The tool plan, the constraint and the rendered prompt of a chat body."""
    setup = state.tool_setup()
    plan = plan_tools(
        [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
        body.tool_choice,
        body.parallel_tool_calls,
        enable_auto_tool_choice=setup.allows_auto,
        tool_call_parser=setup.parser_name,
    )
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    constraint = await _constraint(request, state, body, plan)
    prompt_ids = await _render(state, body, plan.tools, setup.uses_builtin_template)
    if thinking:
        # Told not to think, the model's whole output is the answer it constrains.
        constraint = hold_for_reasoning(state, constraint, prompt_ids)
    return ChatPrompt(plan, thinking, constraint, prompt_ids)


def chat_request_id(body: ChatCompletionRequest) -> str:
    """The response id, which a render gives its GenerateRequest too."""
    return new_request_id("chatcmpl", body.request_id)


@router.post("/v1/chat/completions", responses=GENERATION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    """OpenAI's chat completions, streamed (SSE) or not."""
    pool = admit(state, body)
    prompt = await prepare_chat(request, state, body)
    generation = new_generation(
        state,
        pool,
        body,
        chat_request_id(body),
        [prompt.prompt_ids],
        prompt_param="messages",
        constraint=prompt.constraint,
    )
    formatter = chat_formatter(state, body, prompt, len(generation.choices))
    return await respond(request, generation, formatter, stream=body.stream)


def chat_formatter(
    state: RenderState, body: ChatCompletionRequest, prompt: ChatPrompt, num_choices: int
) -> ChatFormatter:
    """The answer's formatter, a ChoiceProcessor per choice: shared by /v1/chat/completions
    and its derender (http/api/derender.py), so both parse the same text the same way."""
    reasoning_parser = state.settings.reasoning_parser
    processors = [
        ChoiceProcessor(prompt.plan, reasoning_parser, enable_thinking=prompt.thinking)
        for _ in range(num_choices)
    ]
    return ChatFormatter(state, body, processors)


def _echoed_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it has the answer's role (the
    assistant's, or with add_generation_prompt false the last message's own)."""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    if not body.echo or last.role != role:
        return ""
    content = last.content
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


class ChatFormatter(OpenAIFormatter[ChatChunkChoice, ChatChoice]):
    """OpenAI chat completions: `chat.completion.chunk` events, or one `chat.completion`.

    Each choice's text goes through its ChoiceProcessor (reasoning, content, tool calls).
    """

    def __init__(
        self,
        state: RenderState,
        body: ChatCompletionRequest,
        processors: list[ChoiceProcessor],
    ) -> None:
        super().__init__(state, body)
        self.processors = processors
        self.echo = _echoed_text(body)
        """vLLM's chat `echo`: the text each answer starts with."""
        self.logprobs = body.num_logprobs()
        """Top alternatives per token when the request asked for logprobs, else None."""
        self.include_reasoning = body.include_reasoning

    def _finish_reason(self, index: int, reason: FinishReason | None) -> ApiFinishReason | None:
        if reason == "stop" and self.processors[index].called_tools:
            return "tool_calls"
        return reason

    def chunk(
        self, generation: Generation, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            generation.request_id,
            self.created,
            self.model,
            choices,
            usage=usage,
            system_fingerprint=self.system_fingerprint,
        )

    def whole(
        self, generation: Generation, choices: list[ChatChoice], usage: Usage
    ) -> ChatCompletion:
        [prompt] = generation.prompts
        return ChatCompletion(
            id=generation.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            system_fingerprint=self.system_fingerprint,
            prompt_logprobs=self.prompt_logprobs(prompt),
            prompt_token_ids=prompt.prompt_token_ids if self.return_token_ids else None,
        )

    def opening(self, generation: Generation) -> bytes:
        role = ChatDelta(role="assistant", content="")
        events = [
            self.event(generation, ChatChunkChoice(index, role))
            for index in range(len(generation.choices))
        ]
        if self.return_token_ids:
            # As vLLM: the prompt's ids ride on the first chunk.
            usage = usage_of(generation) if self.usage_per_chunk else None
            first = self.chunk(generation, [ChatChunkChoice(0, role)], usage)
            events[0] = sse_event(
                ChatCompletionFirstChunk(
                    **msgspec.structs.asdict(first),
                    prompt_token_ids=generation.prompts[0].prompt_token_ids,
                )
            )
        if self.echo:
            echo = ChatDelta(content=self.echo)
            events += [
                self.event(generation, ChatChunkChoice(index, echo))
                for index in range(len(generation.choices))
            ]
        return b"".join(events)

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        finished = delta.finish_reason is not None
        # Token ids are sent as they come, or a client could not rebuild the output's.
        ids = delta.token_ids if self.return_token_ids else None
        if not delta.text and not finished and self.logprobs is None and not ids:
            return None  # held back (a partial character or a possible stop string)
        logprobs = None
        if self.logprobs is not None:
            logprobs = _chat_logprobs(self.lookup, delta.token_ids, delta.logprobs, self.logprobs)
        processor = self.processors[delta.index]
        piece = processor.feed_last(delta.text) if finished else processor.feed(delta.text)
        if piece.is_empty and not finished and logprobs is None and not ids:
            return None
        reasoning = piece.reasoning if self.include_reasoning else None
        message = ChatDelta(
            content=piece.content or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=piece.tool_calls or None,
        )
        finish = self._finish_reason(delta.index, delta.finish_reason)
        if ids is not None:
            choice: ChatChunkChoice = ChatChunkChoiceWithIds(
                delta.index, message, logprobs, finish, delta.stop_reason, token_ids=ids
            )
        else:
            choice = ChatChunkChoice(delta.index, message, logprobs, finish, delta.stop_reason)
        return self.event(generation, choice)

    def whole_choice(self, choice: Choice) -> ChatChoice:
        logprobs = None
        if self.logprobs is not None:
            logprobs = _chat_logprobs(self.lookup, choice.token_ids, choice.logprobs, self.logprobs)
        result = self.processors[choice.index].whole(choice.text)
        reasoning = result.reasoning if self.include_reasoning else None
        content = result.content
        if self.echo:
            content = self.echo + (content or "")
        message = ChatMessageOut(
            role="assistant",
            content=content,
            tool_calls=result.tool_calls,
            reasoning_content=reasoning,
            reasoning=reasoning,
        )
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            finish_reason=self._finish_reason(choice.index, choice.finish_reason),
            stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if self.return_token_ids else None,
        )
