"""POST /v1/completions: the legacy text completions API (prompt in, text out)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.generation.structured import resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import admit, constraint_validator, new_generation, respond
from render_server.http.formatter import OpenAIFormatter, TokenLookup
from render_server.http.serving import GENERATION_ERRORS, new_request_id
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import CompletionRequest
from render_server.schemas.responses import (
    CompletionBodyChoice,
    CompletionChoice,
    CompletionChoiceWithIds,
    CompletionLogprobs,
    TextCompletion,
    Usage,
)
from shared.protocol import Constraint, TokenLogprobs

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
    lookup: TokenLookup,
    spell: TokenLookup | None,
    token_ids: list[int],
    entries: list[TokenLogprobs] | None,
    top: int,
    offset: int,
    prompt_ids: list[int] | None = None,
) -> CompletionLogprobs:
    """Legacy logprobs; offsets count the text, tokens are spelled by `spell` when given
    (`return_tokens_as_token_ids`), else as their text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id in prompt_ids or []:  # echoed prompt tokens carry no logprobs
        text, _ = lookup(token_id)
        tokens.append(text if spell is None else spell(token_id)[0])
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(offset)
        offset += len(text)
    name = lookup if spell is None else spell
    for token_id, entry in zip(token_ids, entries or [], strict=False):
        text, _ = lookup(token_id)
        tokens.append(text if spell is None else spell(token_id)[0])
        token_logprobs.append(entry.logprob)
        top_logprobs.append(
            {
                name(alt)[0]: lp
                for alt, lp in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False)
            }
        )
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset)


async def prepare_completion(
    request: Request, state: RenderState, body: CompletionRequest
) -> tuple[list[list[int]], Constraint | None]:
    """The prompts and the constraint of a completions body: shared by /v1/completions and
    its render (http/api/render.py), so both send a worker the same thing."""
    constraint = await resolve_constraint(constraint_validator(request, state.tokenizer), body)
    return await _prompts(state, body), constraint


def completion_request_id(body: CompletionRequest) -> str:
    """The response id, which a render gives its GenerateRequest too."""
    return new_request_id("cmpl", body.request_id)


@router.post("/v1/completions", responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    """OpenAI's text completions, streamed (SSE) or not; several prompts allowed."""
    pool = admit(state, body)
    prompts, constraint = await prepare_completion(request, state, body)
    generation = new_generation(
        state,
        pool,
        body,
        completion_request_id(body),
        prompts,
        prompt_param="prompt",
        constraint=constraint,
    )
    formatter = CompletionFormatter(state, body)
    return await respond(request, generation, formatter, stream=body.stream)


class CompletionFormatter(OpenAIFormatter[CompletionChoice, CompletionBodyChoice]):
    """OpenAI text completions: `text_completion` events, or one `text_completion` body.

    Choice `i` of prompt `p` is index `p * n + i`; a choice's first chunk starts with its
    prompt under `echo`, and carries the prompt's ids under `return_token_ids` (as vLLM:
    on the choice, since each prompt has its own).
    """

    def __init__(self, state: RenderState, body: CompletionRequest) -> None:
        super().__init__(state, body)
        self.tokenizer = state.tokenizer
        self.spell = self.lookup if self.tokens_as_ids else None
        self.echo = body.echo
        self.logprobs = body.logprobs
        self._offsets: dict[int, int] = {}  # streamed text so far per choice, for text_offset
        self._started: set[int] = set()  # choices whose first chunk went out

    def chunk(
        self, generation: Generation, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> TextCompletion:
        return TextCompletion(
            generation.request_id,
            self.created,
            self.model,
            choices,
            usage=usage,
            system_fingerprint=self.system_fingerprint,
        )

    def whole(
        self, generation: Generation, choices: list[CompletionBodyChoice], usage: Usage
    ) -> TextCompletion:
        return TextCompletion(
            generation.request_id,
            self.created,
            self.model,
            choices,
            usage=usage,
            system_fingerprint=self.system_fingerprint,
        )

    def _prompt_text(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt.prompt_token_ids, skip_special_tokens=False)

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        index = delta.index
        text = delta.text
        echo_ids = prompt_ids = None
        if (self.echo or self.return_token_ids) and index not in self._started:
            self._started.add(index)
            choice = generation.choices[index]
            prompt_ids = choice.prompt.prompt_token_ids
            if self.echo:
                echo_ids = prompt_ids
                text = self._prompt_text(choice) + text
        ids = delta.token_ids if self.return_token_ids else None
        if not text and delta.finish_reason is None and self.logprobs is None and not ids:
            return None
        logprobs = None
        if self.logprobs is not None:
            offset = self._offsets.get(index, 0)
            logprobs = _logprobs(
                self.text_of,
                self.spell,
                delta.token_ids,
                delta.logprobs,
                self.logprobs,
                offset,
                echo_ids,
            )
            self._offsets[index] = offset + len(text)
        finish, stop = delta.finish_reason, delta.stop_reason
        if ids is None:
            return self.event(generation, CompletionChoice(index, text, logprobs, finish, stop))
        return self.event(
            generation,
            CompletionChoiceWithIds(
                index, text, logprobs, finish, stop, token_ids=ids, prompt_token_ids=prompt_ids
            ),
        )

    def whole_choice(self, choice: Choice) -> CompletionBodyChoice:
        prompt_ids = choice.prompt.prompt_token_ids
        prompt_text = self._prompt_text(choice) if self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            logprobs = _logprobs(
                self.text_of,
                self.spell,
                choice.token_ids,
                choice.logprobs,
                self.logprobs,
                0,
                prompt_ids if self.echo else None,
            )
        return CompletionBodyChoice(
            index=choice.index,
            text=prompt_text + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if self.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs(choice.prompt),
            prompt_token_ids=prompt_ids if self.return_token_ids else None,
        )
