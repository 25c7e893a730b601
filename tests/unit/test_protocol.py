"""Every wire message round-trips; bad frames raise typed errors; the decoder survives."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model_card import ModelCard
from shared.protocol import (
    MAGIC,
    MAX_CONSTRAINT_CHARS,
    MAX_PROMPT_TOKENS,
    PROTOCOL_VERSION,
    Abort,
    BadFrame,
    ClientHeartbeat,
    Constraint,
    Deltas,
    Encoder,
    FrameTooLarge,
    Generate,
    Heartbeat,
    Hello,
    LoadLoRA,
    LoRAResult,
    ProtocolError,
    Rejected,
    RenderMessageDecoder,
    RequestDelta,
    TokenLogprobs,
    UnloadLoRA,
    VersionMismatch,
    Welcome,
    WorkerMessageDecoder,
    WorkerStats,
    merge_delta,
)
from shared.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    SamplingParams,
    SamplingParamsError,
)

CARD = ModelCard(
    model_id="SmolLM2-135M-Instruct",
    tokenizer_digest="ab" * 32,
    vocab_size=49152,
    eos_token_ids=[2],
    bos_token_id=1,
    max_model_len=8192,
)

RENDER_MESSAGES = [
    Hello(client_id="render-1"),
    Generate(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=-5,
            max_tokens=32,
            stop_token_ids=[7],
            logprobs=3,
            logit_bias={5: -100.0},
            prompt_logprobs=2,
            bad_words_token_ids=[[5], [6, 7]],
            allowed_token_ids=[5, 6, 7, 8],
        ),
        priority=2,
        cache_salt="tenant-a",
        arrival_time=12.5,
    ),
    Abort(request_ids=["req-1", "req-2"]),
    ClientHeartbeat(sent_at=1.0),
    Generate(
        request_id="req-lora",
        prompt_token_ids=[1],
        sampling=SamplingParams(),
        lora_name="alpha",
    ),
    LoadLoRA(op_id="op-1", lora_name="alpha", lora_path="adapters/alpha"),
    UnloadLoRA(op_id="op-2", lora_name="alpha"),
]

WORKER_MESSAGES = [
    Welcome(worker_id="w0", model_card=CARD),
    Welcome(worker_id="w1", model_card=msgspec.structs.replace(CARD, scheduling_policy="priority")),
    Deltas(
        deltas=[
            RequestDelta("req-1", [4, 5]),
            RequestDelta(
                "req-2",
                [9],
                finish_reason="stop",
                stop_token_id=2,
                num_prompt_tokens=30,
                num_cached_tokens=16,
                logprobs=[TokenLogprobs(-0.5, 2, [8, 9], [-0.4, -0.5])],
                prompt_logprobs=[None, TokenLogprobs(-1.5, 3), TokenLogprobs(-0.1, 1, [4], [-0.1])],
            ),
        ],
        step=7,
    ),
    Heartbeat(sent_at=3.0, stats=WorkerStats(num_running=1, kv_blocks_total=100)),
    Heartbeat(
        sent_at=4.0,
        stats=WorkerStats(
            lora_registered=["alpha", "beta"],
            lora_resident=["beta"],
            lora_loads=3,
            lora_evictions=2,
        ),
    ),
    Welcome(
        worker_id="w2", model_card=msgspec.structs.replace(CARD, max_loras=4, max_lora_rank=16)
    ),
    Rejected(request_id="req-3", code="too_long", message="prompt is 9000 tokens"),
    Rejected(request_id="req-4", code="lora_not_found", message="no adapter 'gamma'"),
    Rejected(request_id="req-5", code="lora_disabled", message="LoRA is off"),
    LoRAResult(op_id="op-1", ok=True, status=200, message=""),
    LoRAResult(op_id="op-2", ok=False, status=404, message="no adapter 'alpha'"),
]


@pytest.mark.parametrize("message", RENDER_MESSAGES, ids=lambda m: type(m).__name__)
def test_render_messages_round_trip(message: object) -> None:
    frame = Encoder().encode(message)
    assert RenderMessageDecoder().decode(frame) == message


@pytest.mark.parametrize("message", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_messages_round_trip(message: object) -> None:
    frame = Encoder().encode(message)
    assert WorkerMessageDecoder().decode(frame) == message


def test_protocol_version_is_3() -> None:
    # v2 added Generate.constraint, v3 LoRA (Generate.lora_name, LoadLoRA, UnloadLoRA,
    # LoRAResult); a v2 peer is refused at the frame header.
    assert PROTOCOL_VERSION == 3
    frame = bytearray(Encoder().encode(Hello()))
    frame[2] = 2
    with pytest.raises(VersionMismatch):
        RenderMessageDecoder().decode(bytes(frame))


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(kind="json_schema", spec='{"type": "object", "required": ["a"]}'),
        Constraint(kind="json_object"),
        Constraint(kind="regex", spec="[0-9]{3}-[0-9]{4}"),
        Constraint(kind="choice", spec='["yes", "no"]', num_resumed_tokens=3),
        Constraint(kind="grammar", spec='start: "a"+'),
    ],
    ids=lambda c: c.kind,
)
def test_constrained_generate_round_trips(constraint: Constraint) -> None:
    message = Generate(
        request_id="req-c",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=8),
        constraint=constraint,
    )
    decoded = RenderMessageDecoder().decode(Encoder().encode(message))
    assert decoded == message
    assert decoded.constraint == constraint


@pytest.mark.parametrize(
    "constraint",
    [
        {"kind": "xml", "spec": "<a/>"},
        {"kind": "regex", "spec": "a" * (MAX_CONSTRAINT_CHARS + 1)},
        {"kind": "regex", "spec": "a", "num_resumed_tokens": -1},
        {"kind": "regex", "spec": "a", "evil": True},
        {"spec": "a"},
    ],
)
def test_bad_constraints_are_refused_by_the_decoder(constraint: dict) -> None:
    body = {
        "type": "generate",
        "request_id": "a",
        "prompt_token_ids": [1],
        "sampling": {},
        "constraint": constraint,
    }
    frame = MAGIC + bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(body)
    with pytest.raises(BadFrame):
        RenderMessageDecoder().decode(frame)


def test_a_direction_refuses_the_other_directions_messages() -> None:
    frame = Encoder().encode(WORKER_MESSAGES[0])
    with pytest.raises(BadFrame):
        RenderMessageDecoder().decode(frame)


def _body(message: object) -> bytes:
    return msgspec.msgpack.encode(message)


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"", BadFrame),
        (b"D", BadFrame),
        (b"garbage-bytes", BadFrame),
        (MAGIC + bytes([PROTOCOL_VERSION]), BadFrame),
        (MAGIC + bytes([PROTOCOL_VERSION]) + b"\xc1", BadFrame),
        (MAGIC + bytes([PROTOCOL_VERSION + 1]) + _body(Hello()), VersionMismatch),
        (MAGIC + bytes([0]) + _body(Hello()), VersionMismatch),
    ],
)
def test_bad_frames_raise_typed_errors(frame: bytes, error: type[ProtocolError]) -> None:
    decoder = RenderMessageDecoder()
    with pytest.raises(error):
        decoder.decode(frame)
    # the same decoder keeps working
    assert decoder.decode(Encoder().encode(Hello())) == Hello()


def test_truncated_frames_raise() -> None:
    frame = Encoder().encode(RENDER_MESSAGES[1])
    decoder = RenderMessageDecoder()
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            decoder.decode(frame[:cut])
    assert decoder.decode(frame) == RENDER_MESSAGES[1]


def test_oversized_frame_raises() -> None:
    decoder = RenderMessageDecoder(max_frame_bytes=1024)
    big = Generate(request_id="x", prompt_token_ids=[1] * 2000, sampling=SamplingParams())
    with pytest.raises(FrameTooLarge):
        decoder.decode(Encoder().encode(big))


@pytest.mark.parametrize(
    "body",
    [
        {"type": "generate", "request_id": "a", "prompt_token_ids": [-1], "sampling": {}},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [], "sampling": {}},
        {"type": "generate", "request_id": "", "prompt_token_ids": [1], "sampling": {}},
        {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "sampling": {"n": 2}},
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {"temperature": -1.0},
        },
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {"max_tokens": 0},
        },
        # msgpack carries it as a uint64; priority is a signed 64-bit integer.
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {},
            "priority": (1 << 64) - 1,
        },
        *(
            {"type": "generate", "request_id": "a", "prompt_token_ids": [1], "sampling": sampling}
            for sampling in [
                {"prompt_logprobs": 21},
                {"prompt_logprobs": -1},
                {"allowed_token_ids": []},
                {"allowed_token_ids": [-1]},
                {"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))},
                {"bad_words_token_ids": [[]]},
                {"bad_words_token_ids": [[-3]]},
                {"bad_words_token_ids": [list(range(MAX_BAD_WORD_TOKENS + 1))]},
                {"bad_words_token_ids": [[1]] * (MAX_BAD_WORDS + 1)},
            ]
        ),
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {},
            "lora_name": "",
        },
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {},
            "lora_name": "x" * 129,
        },
        {"type": "load_lora", "op_id": "o", "lora_name": "a"},
        {"type": "load_lora", "op_id": "o", "lora_name": "a", "lora_path": "p" * 4097},
        {"type": "unload_lora", "op_id": "", "lora_name": "a"},
        {"type": "hello", "protocol_version": 1, "evil": True},
        {"type": "no_such_message"},
        {"type": "abort", "request_ids": "not-a-list"},
        ["not", "a", "map"],
    ],
)
def test_out_of_range_or_unknown_content_is_refused(body: object) -> None:
    frame = MAGIC + bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(body)
    with pytest.raises(BadFrame):
        RenderMessageDecoder().decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    decoder = RenderMessageDecoder()
    for frame in (data, MAGIC + bytes([PROTOCOL_VERSION]) + data):
        with contextlib.suppress(ProtocolError):
            decoder.decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_mutated_frames_never_escape_as_other_errors(position: int, byte: int) -> None:
    frame = bytearray(Encoder().encode(RENDER_MESSAGES[1]))
    frame[position % len(frame)] = byte
    with contextlib.suppress(ProtocolError):
        RenderMessageDecoder().decode(bytes(frame))


def test_a_default_card_decodes_where_the_policy_field_is_unknown() -> None:
    # A render server that predates `scheduling_policy` refuses unknown fields: a card
    # with the default policy leaves it out, so such a render still accepts fcfs workers.
    class OldCard(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        model_id: str
        tokenizer_digest: str
        vocab_size: int
        eos_token_ids: list[int]
        bos_token_id: int | None = None
        max_model_len: int
        block_size: int = 16
        architecture: str = "llama"
        dtype: str = "float32"

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(CARD), type=OldCard)
    assert old.max_model_len == CARD.max_model_len
    # And a new render reads an old worker's card as fcfs.
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=ModelCard)
    assert new == CARD
    assert new.scheduling_policy == "fcfs"


def test_prompt_logprobs_arrive_once_and_survive_coalescing() -> None:
    entries = [None, TokenLogprobs(-1.0, 2)]
    into = RequestDelta("r", [1], prompt_logprobs=entries, queue_time=0.1)
    merge_delta(into, RequestDelta("r", [2]))
    assert into.prompt_logprobs == entries
    late = RequestDelta("r", [1])
    merge_delta(late, RequestDelta("r", [2], prompt_logprobs=entries))
    assert late.prompt_logprobs == entries


def test_prompt_logprobs_are_bounded_on_the_wire() -> None:
    delta = RequestDelta("r", [1], prompt_logprobs=[None] * (MAX_PROMPT_TOKENS + 1))
    with pytest.raises(BadFrame):
        WorkerMessageDecoder().decode(Encoder().encode(Deltas(deltas=[delta])))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [100]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3], "bad_words_token_ids": [[3], [4]]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
        ({"bad_words_token_ids": [[1, 100]]}, "bad_words"),
        ({"bad_words_token_ids": [[1] * (MAX_BAD_WORD_TOKENS + 1)]}, "bad_words"),
        ({"bad_words_token_ids": [[1]] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ],
)
def test_new_sampling_fields_are_validated_by_name(fields: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**fields).validate(vocab_size=100)
    assert info.value.param == param


def test_a_multi_token_bad_word_may_share_tokens_with_allowed_ids() -> None:
    SamplingParams(allowed_token_ids=[3], bad_words_token_ids=[[3, 3]]).validate(vocab_size=100)
