"""Request fields -> per-choice SamplingParams, with every bound checked before a worker
sees anything. Errors are 400s whose `param` is the field as the client spelled it."""

from __future__ import annotations

import msgspec

from render_server.generation.lifecycle import ChoiceSpec
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import UNSUPPORTED_FIELDS, SamplingFields
from shared.sampling import INT64_MAX, INT64_MIN, SamplingParams, SamplingParamsError


def reject_unsupported(body: SamplingFields) -> None:
    """400 for a field duet does not support yet, when the client actually set it."""
    for name, why in UNSUPPORTED_FIELDS.items():
        if name in body.model_fields_set and getattr(body, name, None) not in (None, [], {}):
            raise ApiError(400, f"{name}: {why}.", param=name, code="unsupported_parameter")


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
) -> list[ChoiceSpec]:
    """One ChoiceSpec per choice (n of them), validated."""
    if not 1 <= body.n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n}, got {body.n}.", param="n")
    stops = body.stop_strings()
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX - max_n:
        raise ApiError(400, "seed must fit in a signed 64-bit integer.", param="seed")
    fields: dict[str, object] = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        if getattr(body, name) is not None
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
        )
        base = msgspec.structs.replace(base, **fields)  # only what the request set
        base.validate(vocab_size)
    except SamplingParamsError as exc:
        raise ApiError(400, exc.message, param=exc.param) from exc
    choices = []
    for index in range(body.n):
        sampling = base
        if body.seed is not None and index:
            sampling = msgspec.structs.replace(base, seed=body.seed + index)
        choices.append(
            ChoiceSpec(
                sampling=sampling,
                stop=stops,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
            )
        )
    return choices
