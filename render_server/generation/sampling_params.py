"""Request fields -> per-choice SamplingParams, with every bound checked before a worker
sees anything. Errors are 400s whose `param` is the field as the client spelled it."""

from __future__ import annotations

import msgspec

from render_server.generation.lifecycle import ChoiceSpec
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import DISTRIBUTION_FIELDS, SamplingFields
from render_server.schemas.vllm_fields import UNSUPPORTED_FIELDS
from render_server.templating.tokenizer import Tokenizer
from shared.model_card import ModelCard
from shared.sampling import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError


def reject_unsupported(body: SamplingFields) -> None:
    """400 for a field duet does not support, when the client set it to anything but
    its default (vLLM's)."""
    fields = type(body).model_fields
    for name, why in UNSUPPORTED_FIELDS.items():
        if name in body.model_fields_set and getattr(body, name) != fields[name].default:
            raise ApiError(400, f"{name}: {why}.", param=name, code="unsupported_parameter")


def check_priority(priority: int, card: ModelCard | None) -> None:
    """A priority other than 0 needs workers that schedule by it (as vLLM refuses it)."""
    policy = card.scheduling_policy if card is not None else "fcfs"
    if priority != 0 and policy != "priority":
        raise ApiError(
            400,
            f"priority: the workers schedule {policy!r}, so priority must be 0 (they order "
            "requests by it only under --scheduling-policy priority).",
            param="priority",
            code="unsupported_parameter",
        )


def truncate_prompt(
    prompt_ids: list[int], keep: int | None, max_model_len: int, requested: int | None
) -> list[int]:
    """The last `keep` prompt tokens (vLLM's truncate_prompt_tokens); -1 keeps as many as
    fit the context with room for the requested output (one token when unset)."""
    if keep is None:
        return prompt_ids
    if keep > max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens ({keep}) is larger than the context ({max_model_len}).",
            param="truncate_prompt_tokens",
        )
    if keep == -1:
        keep = max_model_len - max(requested or 1, 1)
    return prompt_ids[-keep:] if 0 < keep < len(prompt_ids) else prompt_ids


def with_special_tokens(tokenizer: Tokenizer, token_ids: list[int]) -> list[int]:
    """A rendered chat's ids with the special tokens the tokenizer adds (its BOS, if it
    adds one and the template did not): the template's text is already tokenized."""
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and token_ids[:1] != [bos]:
        return [bos, *token_ids]
    return token_ids


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token sequences, as vLLM tokenizes them: the word as it starts a
    text, and with a leading space when that spells it with other tokens of the same
    count (a word in the middle of a text)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced[:1] != bare[:1] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def check_prompt_length(prompt_len: int, max_model_len: int, param: str) -> None:
    if prompt_len == 0:
        raise ApiError(400, f"{param}: the prompt is empty.", param=param)
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{param} has {prompt_len} tokens, which leaves no room for output. Please "
            f"reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    requested: int | None, param: str, prompt_len: int, max_model_len: int
) -> int:
    """The request's max_tokens, or everything left of the context when unset."""
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested < 1:
        raise ApiError(400, f"{param} must be at least 1, got {requested}.", param=param)
    if requested > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce {param} or the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    # The schema checked that every key is a token id.
    return None if raw is None else {int(key): value for key, value in raw.items()}


def build_choices(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    max_n: int,
    bad_words: list[list[int]] | None = None,
) -> list[ChoiceSpec]:
    """One ChoiceSpec per choice (n of them), validated; `bad_words` are the request's,
    tokenized (`bad_words_token_ids`)."""
    if not 1 <= body.n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n}, got {body.n}.", param="n")
    stops = body.stop_strings()
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX - max_n:
        raise ApiError(400, "seed must fit in a signed 64-bit integer.", param="seed")
    fields: dict[str, object] = {
        name: getattr(body, name) for name in DISTRIBUTION_FIELDS if getattr(body, name) is not None
    }
    try:
        base = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias=_logit_bias(body.logit_bias),
            seed=body.seed,
            prompt_logprobs=body.prompt_logprobs,
            bad_words_token_ids=bad_words or [],
            allowed_token_ids=body.allowed_token_ids,
        )
        base = msgspec.structs.replace(base, **fields)  # only what the request set
        base.validate(vocab_size)
    except SamplingParamsError as exc:
        raise ApiError(400, exc.message, param=exc.param) from exc
    choices = []
    # The prompt's logprobs are the same for every choice: only the first scores them (a
    # request that does skips the prefix cache; the others keep it).
    rest = msgspec.structs.replace(base, prompt_logprobs=None)
    for index in range(body.n):
        sampling = rest if index else base
        if body.seed is not None and index:
            sampling = msgspec.structs.replace(sampling, seed=body.seed + index)
        choices.append(
            ChoiceSpec(
                sampling=sampling,
                stop=stops,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
            )
        )
    return choices
