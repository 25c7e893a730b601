"""POST /v1/completions: the legacy text completions API (prompt in, text out)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.generation.structured import resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import admit, constraint_validator, new_generation, respond
from render_server.http.formatter import OpenAIFormatter
from render_server.http.serving import GENERATION_ERRORS, new_request_id
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import CompletionRequest
from render_server.schemas.responses import (
    CompletionChoice,
    CompletionLogprobs,
    TextCompletion,
    Usage,
)
from render_server.templating.token_text import TokenText
from shared.protocol import TokenLogprobs

router = APIRouter(tags=["generation"])


async def _prompts(state: RenderState, body: CompletionRequest) -> list[list[int]]:
    """Every prompt form as token ids: a string, strings, ids, or lists of ids."""
    texts = body.prompt_texts()
    if texts is not None:
        return await state.tokenizer.encode_batch_async(texts, body.add_special_tokens)
    id_lists = body.prompt_token_ids()
    vocab_size = state.tokenizer.vocab_size
    for ids in id_lists:
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
                raise ApiError(
                    400,
                    f"prompt: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
                    param="prompt",
                )
    return id_lists


def _logprobs(
    token_text: TokenText,
    token_ids: list[int],
    entries: list[TokenLogprobs] | None,
    top: int,
    offset: int,
    prompt_ids: list[int] | None = None,
) -> CompletionLogprobs:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id in prompt_ids or []:  # echoed prompt tokens carry no logprobs
        text, _ = token_text.lookup(token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(offset)
        offset += len(text)
    for token_id, entry in zip(token_ids, entries or [], strict=False):
        text, _ = token_text.lookup(token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(
            {
                token_text.lookup(alt)[0]: lp
                for alt, lp in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False)
            }
        )
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset)


@router.post("/v1/completions", responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    """OpenAI's text completions, streamed (SSE) or not; several prompts allowed."""
    pool = admit(state, body)
    constraint = await resolve_constraint(constraint_validator(request, state.tokenizer), body)
    generation = new_generation(
        state,
        pool,
        body,
        new_request_id("cmpl"),
        await _prompts(state, body),
        prompt_param="prompt",
        constraint=constraint,
    )
    formatter = CompletionFormatter(state, body)
    return await respond(request, generation, formatter, stream=body.stream)


class CompletionFormatter(OpenAIFormatter[CompletionChoice, CompletionChoice]):
    """OpenAI text completions: `text_completion` events, or one `text_completion` body.

    Choice `i` of prompt `p` is index `p * n + i`; with `echo`, a choice's first text
    starts with its prompt.
    """

    def __init__(self, state: RenderState, body: CompletionRequest) -> None:
        super().__init__(state.model_id, body.stream_options)
        self.tokenizer = state.tokenizer
        self.token_text = state.token_text
        self.echo = body.echo
        self.logprobs = body.logprobs
        self._offsets: dict[int, int] = {}  # streamed text so far per choice, for text_offset
        self._echoed: set[int] = set()

    def chunk(
        self, generation: Generation, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> TextCompletion:
        return TextCompletion(generation.request_id, self.created, self.model, choices, usage=usage)

    def whole(
        self, generation: Generation, choices: list[CompletionChoice], usage: Usage
    ) -> TextCompletion:
        return self.chunk(generation, choices, usage)

    def _prompt_text(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt.prompt_token_ids, skip_special_tokens=False)

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        index = delta.index
        text = delta.text
        echo_ids = None
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            choice = generation.choices[index]
            echo_ids = choice.prompt.prompt_token_ids
            text = self._prompt_text(choice) + text
        if not text and delta.finish_reason is None and self.logprobs is None:
            return None
        logprobs = None
        if self.logprobs is not None:
            offset = self._offsets.get(index, 0)
            logprobs = _logprobs(
                self.token_text, delta.token_ids, delta.logprobs, self.logprobs, offset, echo_ids
            )
            self._offsets[index] = offset + len(text)
        return self.event(
            generation,
            CompletionChoice(index, text, logprobs, delta.finish_reason, delta.stop_reason),
        )

    def whole_choice(self, choice: Choice) -> CompletionChoice:
        prompt_text = self._prompt_text(choice) if self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            echo_ids = choice.prompt.prompt_token_ids if self.echo else None
            logprobs = _logprobs(
                self.token_text, choice.token_ids, choice.logprobs, self.logprobs, 0, echo_ids
            )
        return CompletionChoice(
            index=choice.index,
            text=prompt_text + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
