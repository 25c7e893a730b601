"""Fuzzing the wire: both decoders, then a real gpu-worker over its socket.

Decoders get random bytes, mutated valid frames (byte flips, truncations, insertions,
deletions, splices of two frames) and well-formed msgpack that is not a valid message
(the right tags with wrong fields and values). Only `ProtocolError` subclasses may
escape; whatever decodes re-encodes to a frame that decodes to the same bytes; and the
decoder keeps working after every failure.

The worker gets bursts of such frames from peers that never said Hello, and Generates
with extreme but decodable fields from one that did: it drops and counts every bad frame
(heartbeat `bad_frames`), answers every decodable Generate (a Rejected or a finished
stream), and then still serves a normal greedy request with the same tokens as before.
The smaller, hand-written cases live in test_protocol.py and test_worker_server.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    ProtocolError,
    Rejected,
    RenderMessageDecoder,
    RenderToWorker,
    WorkerMessageDecoder,
    WorkerToRender,
)
from shared.sampling import SamplingParams
from shared.transport import make_dealer
from tests.helpers.processes import WorkerProcess, start_worker, stop_worker
from tests.helpers.waiting import wait_until
from tests.integration.test_worker_server import PROMPT, Client
from tests.unit.test_protocol import RENDER_MESSAGES, WORKER_MESSAGES

HEADER = MAGIC + bytes([PROTOCOL_VERSION])
ENCODER = Encoder()
RENDER_FRAMES = [ENCODER.encode(message) for message in RENDER_MESSAGES]
WORKER_FRAMES = [ENCODER.encode(message) for message in WORKER_MESSAGES]
VALID_FRAMES = RENDER_FRAMES + WORKER_FRAMES
VOCAB_SIZE = 49152


def _message_classes(union: object) -> list[type[msgspec.Struct]]:
    return list(union.__args__)  # type: ignore[attr-defined]


def _field_names() -> list[str]:
    """Every field name of every wire struct, nested ones included: fuzzed maps use them
    so msgspec's validation (not just its parser) gets exercised."""
    names: set[str] = set()
    pending = _message_classes(RenderToWorker) + _message_classes(WorkerToRender)
    seen: set[type] = set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for field in msgspec.structs.fields(cls):
            names.add(field.encode_name)
            for inner in getattr(field.type, "__args__", ()) or (field.type,):
                if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                    pending.append(inner)
    return sorted(names)


TAGS = [cls.__struct_config__.tag for cls in _message_classes(RenderToWorker)] + [
    cls.__struct_config__.tag for cls in _message_classes(WorkerToRender)
]
FIELDS = _field_names()

# ---- strategies ---------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24)
    | st.binary(max_size=24)
)
_keys = st.sampled_from(FIELDS) | st.text(max_size=12) | st.integers(-5, 1 << 40)
msgpack_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_keys, inner, max_size=6),
    max_leaves=24,
)


@st.composite
def tagged_maps(draw: st.DrawFn) -> bytes:
    """A frame whose body is a map with a real message tag and random known fields."""
    body = {"type": draw(st.sampled_from(TAGS))}
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS), msgpack_values, max_size=8)))
    return HEADER + msgspec.msgpack.encode(body)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame of either direction after one to five random edits."""
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 5))):
        position = draw(st.integers(0, len(frame)))
        operation = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "splice"]))
        at = min(position, len(frame) - 1)
        if operation == "flip" and frame:
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif operation == "set" and frame:
            frame[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xFF]))
        elif operation == "truncate":
            del frame[position:]
        elif operation == "insert":
            frame[position:position] = draw(st.binary(min_size=1, max_size=16))
        elif operation == "delete":
            del frame[position : position + draw(st.integers(1, 16))]
        elif operation == "splice":
            other = draw(st.sampled_from(VALID_FRAMES))
            frame[position:] = other[draw(st.integers(0, len(other))) :]
    return bytes(frame)


random_frames = st.binary(max_size=512) | st.binary(max_size=512).map(lambda body: HEADER + body)
any_frame = (
    random_frames
    | mutated_frames()
    | tagged_maps()
    | msgpack_values.map(lambda value: HEADER + msgspec.msgpack.encode(value))
)


# ---- decoders -----------------------------------------------------------------------


def _check_decoder(decoder: RenderMessageDecoder | WorkerMessageDecoder, frame: bytes) -> None:
    for view in (frame, memoryview(frame)):
        try:
            message = decoder.decode(view)
        except ProtocolError:
            continue
        # Accepted means well-formed: it re-encodes to a frame that decodes to the same
        # bytes again (compared as bytes, since a float field may hold NaN).
        again = ENCODER.encode(message)
        assert ENCODER.encode(decoder.decode(again)) == again


# A frame decodes in milliseconds; 400 examples at this deadline fit pytest-timeout's 300 s.
FRAME_DEADLINE = timedelta(milliseconds=500)


@pytest.mark.slow  # hundreds of hypothesis examples
@settings(max_examples=400, deadline=FRAME_DEADLINE)
@given(any_frame)
def test_render_decoder_only_raises_protocol_errors(frame: bytes) -> None:
    decoder = RenderMessageDecoder()
    _check_decoder(decoder, frame)
    assert decoder.decode(RENDER_FRAMES[1]) == RENDER_MESSAGES[1]


@pytest.mark.slow  # hundreds of hypothesis examples
@settings(max_examples=400, deadline=FRAME_DEADLINE)
@given(any_frame)
def test_worker_decoder_only_raises_protocol_errors(frame: bytes) -> None:
    decoder = WorkerMessageDecoder()
    _check_decoder(decoder, frame)
    assert decoder.decode(WORKER_FRAMES[1]) == WORKER_MESSAGES[1]


@pytest.mark.slow  # hundreds of hypothesis examples
@settings(max_examples=200, deadline=None)
@given(st.lists(any_frame, min_size=2, max_size=20))
def test_one_decoder_survives_a_sequence_of_bad_frames(frames: list[bytes]) -> None:
    render, worker = RenderMessageDecoder(), WorkerMessageDecoder()
    for frame in frames:
        _check_decoder(render, frame)
        _check_decoder(worker, frame)
    assert render.decode(RENDER_FRAMES[0]) == RENDER_MESSAGES[0]
    assert worker.decode(WORKER_FRAMES[2]) == WORKER_MESSAGES[2]


def test_every_truncation_and_single_byte_flip_of_every_message_is_typed() -> None:
    """Exhaustive where it is cheap: every prefix and every one-bit flip of each frame."""
    render, worker = RenderMessageDecoder(), WorkerMessageDecoder()
    for frame in VALID_FRAMES:
        for cut in range(len(frame)):
            _check_decoder(render, frame[:cut])
            _check_decoder(worker, frame[:cut])
        for index in range(len(frame)):
            for bit in range(8):
                flipped = bytearray(frame)
                flipped[index] ^= 1 << bit
                _check_decoder(render, bytes(flipped))
                _check_decoder(worker, bytes(flipped))


# ---- a real worker over its socket --------------------------------------------------


def _is_bad(frame: bytes) -> bool:
    try:
        RenderMessageDecoder().decode(frame)
    except ProtocolError:
        return True
    return False


def _decodes_to_hello(frame: bytes) -> bool:
    try:
        return isinstance(RenderMessageDecoder().decode(frame), Hello)
    except ProtocolError:
        return False


@pytest.fixture(scope="module")
def fuzz_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log: Path = tmp_path_factory.mktemp("wire-fuzz") / "worker.log"
    worker = start_worker(log, ["--max-model-len", "512"])
    yield worker
    stop_worker(worker)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]


def _greedy(client: Client, request_id: str) -> list[int]:
    client.send(
        Generate(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        )
    )
    return [token for delta in client.collect(request_id) for token in delta.new_token_ids]


def _bad_frames(client: Client, at_least: int, timeout_s: float = 10.0) -> int:
    """The worker's bad-frame count once it reaches `at_least`."""
    wait_until(
        lambda: client.recv_until(Heartbeat).stats.bad_frames >= at_least,
        timeout_s,
        f"the worker to count {at_least} bad frames",
        interval_s=0,
    )
    # one more beat: a count that overshoots would show up here
    return client.recv_until(Heartbeat).stats.bad_frames


def _assert_idle(client: Client, timeout_s: float = 10.0) -> None:
    stats = None

    def idle() -> bool:
        nonlocal stats
        stats = client.recv_until(Heartbeat).stats
        return stats.num_running == stats.num_waiting == 0 and (
            stats.kv_blocks_free == stats.kv_blocks_total
        )

    wait_until(idle, timeout_s, "the worker to return to idle", interval_s=0, detail=lambda: stats)


@pytest.mark.slow  # a worker process
def test_worker_survives_bursts_of_bad_frames_and_counts_them(fuzz_worker: WorkerProcess) -> None:
    client = Client(fuzz_worker.address)
    context = zmq.Context()
    attackers = [
        make_dealer(context, fuzz_worker.address, identity=uuid.uuid4().bytes) for _ in range(3)
    ]
    try:
        client.send(Hello(client_id="fuzz-observer"))
        before = _greedy(client, "before")
        baseline = client.recv_until(Heartbeat).stats.bad_frames
        expected = [0]

        # Bursts from peers that never said Hello: decodable frames are refused (a
        # Generate gets Rejected("protocol")), undecodable ones dropped and counted.
        @settings(max_examples=25, deadline=None, database=None)
        @given(
            st.lists(any_frame, min_size=1, max_size=40),
            st.lists(st.lists(st.binary(max_size=32), min_size=2, max_size=4), max_size=3),
            st.integers(0, len(attackers) - 1),
        )
        def burst(frames: list[bytes], multiparts: list[list[bytes]], which: int) -> None:
            socket = attackers[which]
            for frame in frames:
                if _decodes_to_hello(frame):
                    continue  # a Hello would make the attacker a real client
                socket.send(frame)
                expected[0] += _is_bad(frame)
            for parts in multiparts:
                socket.send_multipart(parts)  # the ROUTER sees 3+ frames: bad
                expected[0] += 1

        burst()
        counted = _bad_frames(client, baseline + expected[0])
        assert counted - baseline == expected[0]
        # and it still serves, with the same greedy tokens as before the bursts
        assert _greedy(client, "after") == before
    finally:
        for socket in attackers:
            socket.close()
        context.term()
        client.close()


_weird_floats = st.floats(allow_nan=True, allow_infinity=True)
_edge_ids = st.sampled_from([0, 2, VOCAB_SIZE - 1, VOCAB_SIZE, (1 << 31) - 1])

# Each drawn Generate is ordinary but for up to three of these, pushed to an extreme, so
# most reach the engine and the rest exercise the worker's own checks.
_SAMPLING_EXTREMES: dict[str, st.SearchStrategy] = {
    "temperature": st.sampled_from([1e-30, 100.0]) | _weird_floats,
    "top_p": st.sampled_from([1e-30, 1.0]),
    "top_k": st.sampled_from([-1, 1, VOCAB_SIZE, VOCAB_SIZE + 1, 1 << 20]),
    "min_p": st.sampled_from([0.0, 1.0]),
    "presence_penalty": st.sampled_from([-2.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 2.0]),
    "repetition_penalty": st.sampled_from([1e-30, 10.0]),
    "seed": st.sampled_from([-(1 << 63), -1, (1 << 63) - 1]),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(_edge_ids, max_size=64),
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([0, 20]),
    "logit_bias": st.dictionaries(
        st.sampled_from([0, 2, VOCAB_SIZE - 1, VOCAB_SIZE, 1 << 40, -1]),
        st.sampled_from([-100.0, 100.0]) | _weird_floats,
        max_size=3,
    ),
}
_REQUEST_EXTREMES: dict[str, st.SearchStrategy] = {
    "prompt_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=300)
    | st.lists(_edge_ids, min_size=1, max_size=4),
    "priority": st.sampled_from([-(1 << 63), (1 << 63) - 1]),
    "cache_salt": st.text(max_size=64),
    "arrival_time": st.sampled_from([-1.0, 1e300]) | _weird_floats,
}


@st.composite
def odd_generates(draw: st.DrawFn, index: int) -> bytes:
    """A Generate frame with a few extreme fields and at most 3 tokens to generate."""
    sampling: dict[str, object] = {"temperature": 0.0, "max_tokens": draw(st.integers(1, 3))}
    body: dict[str, object] = {
        "type": "generate",
        "request_id": f"{index}-{draw(st.text(min_size=1, max_size=40))}"[:256],
        "prompt_token_ids": PROMPT[: draw(st.integers(1, len(PROMPT)))],
        "sampling": sampling,
    }
    names = sorted(_SAMPLING_EXTREMES) + sorted(_REQUEST_EXTREMES)
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if name in _SAMPLING_EXTREMES:
            sampling[name] = draw(_SAMPLING_EXTREMES[name])
        else:
            body[name] = draw(_REQUEST_EXTREMES[name])
    return HEADER + msgspec.msgpack.encode(body)


def _outcome(client: Client, request_ids: set[str], timeout_s: float) -> dict[str, str]:
    """How each request ended: its finish reason, or "rejected:<code>"."""
    ended: dict[str, str] = {}

    def all_ended() -> bool:
        if ended.keys() >= request_ids:
            return True
        message = client.poll(0.1)
        if isinstance(message, Deltas):
            for delta in message.deltas:
                if delta.finish_reason is not None:
                    ended[delta.request_id] = delta.finish_reason
        elif isinstance(message, Rejected):
            ended[message.request_id] = f"rejected:{message.code}"
        return False

    wait_until(
        all_ended,
        timeout_s,
        "every request to end",
        interval_s=0,
        detail=lambda: f"no answer for {request_ids - ended.keys()}",
    )
    return ended


@pytest.mark.slow  # a worker process
def test_worker_answers_every_odd_but_decodable_generate(fuzz_worker: WorkerProcess) -> None:
    client = Client(fuzz_worker.address)
    try:
        client.send(Hello(client_id="fuzz-odd"))
        before = _greedy(client, "odd-before")
        sent: list[int] = [0]

        @settings(max_examples=12, deadline=None, database=None)
        @given(st.data())
        def batch(data: st.DataObject) -> None:
            frames = [data.draw(odd_generates(sent[0] + i)) for i in range(4)]
            sent[0] += len(frames)
            waiting = set()
            for frame in frames:
                try:
                    message = RenderMessageDecoder().decode(frame)
                except ProtocolError:
                    continue  # out of the wire bounds: the worker drops it (tested above)
                client.socket.send(frame)
                waiting.add(message.request_id)
            ended = _outcome(client, waiting, timeout_s=60)
            assert ended.keys() == waiting, f"no answer for {waiting - ended.keys()}"
            for request_id, how in ended.items():
                assert how in ("stop", "length", "rejected:invalid_request"), (request_id, how)

        batch()
        assert _greedy(client, "odd-after") == before
        _assert_idle(client)
    finally:
        client.close()
