"""POST /v1/chat/completions: render the chat, generate on the workers, answer as OpenAI."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.generation.structured import check_constraint, resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import admit, constraint_validator, new_generation, respond
from render_server.http.formatter import OpenAIFormatter
from render_server.http.serving import GENERATION_ERRORS, new_request_id
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.parsing.reasoning import get_reasoning_parser
from render_server.parsing.tool_choice import ToolPlan, plan_tools, tool_setup
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import ChatCompletionRequest
from render_server.schemas.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)
from render_server.schemas.responses import FinishReason as ApiFinishReason
from render_server.templating.chat_template import ChatTemplateError, RequestTemplateNotAllowed
from render_server.templating.token_text import TokenText
from shared.protocol import Constraint, FinishReason, TokenLogprobs

router = APIRouter(tags=["generation"])


def _chat_logprobs(
    token_text: TokenText, token_ids: list[int], entries: list[TokenLogprobs] | None, top: int
) -> ChatChoiceLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text, raw = token_text.lookup(token_id)
        alternatives = []
        for alt_id, alt_logprob in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False):
            alt_text, alt_raw = token_text.lookup(alt_id)
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
    return rendered.token_ids


async def _constraint(
    request: Request,
    state: RenderState,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    thinking: bool,
) -> Constraint | None:
    """The request's structured-output constraint, or the tool choice's; held off until
    reasoning ended when a reasoning parser splits it off."""
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
    settings = state.settings
    if (
        constraint is not None
        and settings.reasoning_parser is not None
        and thinking
        and not settings.structured_outputs_in_reasoning
    ):
        # Reasoning is free text: the constraint holds only for the answer after it.
        end_tag = get_reasoning_parser(settings.reasoning_parser).end_tag
        constraint = msgspec.structs.replace(constraint, start_after=end_tag)
    return constraint


@router.post("/v1/chat/completions", responses=GENERATION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    """OpenAI's chat completions, streamed (SSE) or not."""
    pool = admit(state, body)
    settings = state.settings
    setup = tool_setup(
        tool_call_parser=settings.tool_call_parser,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        chat_template=state.renderer.chat_template,
        builtin_template=state.renderer.tools_template,
    )
    plan = plan_tools(
        [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
        body.tool_choice,
        body.parallel_tool_calls,
        enable_auto_tool_choice=setup.allows_auto,
        tool_call_parser=setup.parser_name,
    )
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    constraint = await _constraint(request, state, body, plan, thinking)
    prompt_ids = await _render(state, body, plan.tools, setup.uses_builtin_template)
    generation = new_generation(
        state,
        pool,
        body,
        new_request_id("chatcmpl"),
        [prompt_ids],
        prompt_param="messages",
        constraint=constraint,
    )
    processors = [
        ChoiceProcessor(plan, settings.reasoning_parser, enable_thinking=thinking)
        for _ in generation.choices
    ]
    formatter = ChatFormatter(state, body, processors)
    return await respond(request, generation, formatter, stream=body.stream)


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
        super().__init__(state.model_id, body.stream_options)
        self.token_text = state.token_text
        self.processors = processors
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
            generation.request_id, self.created, self.model, choices, usage=usage
        )

    def whole(
        self, generation: Generation, choices: list[ChatChoice], usage: Usage
    ) -> ChatCompletion:
        return ChatCompletion(
            id=generation.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def opening(self, generation: Generation) -> bytes:
        role = ChatDelta(role="assistant", content="")
        return b"".join(
            self.event(generation, ChatChunkChoice(index, role))
            for index in range(len(generation.choices))
        )

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        finished = delta.finish_reason is not None
        if not delta.text and not finished and self.logprobs is None:
            return None  # held back (a partial character or a possible stop string)
        logprobs = None
        if self.logprobs is not None:
            logprobs = _chat_logprobs(
                self.token_text, delta.token_ids, delta.logprobs, self.logprobs
            )
        processor = self.processors[delta.index]
        piece = processor.feed_last(delta.text) if finished else processor.feed(delta.text)
        if piece.is_empty and not finished and logprobs is None:
            return None
        reasoning = piece.reasoning if self.include_reasoning else None
        message = ChatDelta(
            content=piece.content or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=piece.tool_calls or None,
        )
        finish = self._finish_reason(delta.index, delta.finish_reason)
        choice = ChatChunkChoice(delta.index, message, logprobs, finish, delta.stop_reason)
        return self.event(generation, choice)

    def whole_choice(self, choice: Choice) -> ChatChoice:
        logprobs = None
        if self.logprobs is not None:
            logprobs = _chat_logprobs(
                self.token_text, choice.token_ids, choice.logprobs, self.logprobs
            )
        result = self.processors[choice.index].whole(choice.text)
        reasoning = result.reasoning if self.include_reasoning else None
        message = ChatMessageOut(
            role="assistant",
            content=result.content,
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
        )
