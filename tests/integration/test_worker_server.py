"""gpu-worker as a real process over real ZMQ on loopback."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared.protocol import (
    MAGIC,
    Abort,
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    Rejected,
    RequestDelta,
    Welcome,
    WorkerMessageDecoder,
)
from shared.sampling import SamplingParams
from shared.transport import make_dealer
from tests.helpers.processes import SMALL_WORKER, start_worker, stop_worker
from tests.helpers.waiting import wait_until

PROMPT = [1, 4093, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
BLOCK_SIZE = 16  # the worker's default --block-size, as its Welcome says
# Two full blocks and a tail, and no other test's prefix: a repeat finds exactly 32 tokens.
CACHEABLE_PROMPT = list(range(1000, 1040))
STARTUP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    worker = start_worker(None, startup_s=STARTUP_TIMEOUT_S, **SMALL_WORKER)
    yield worker.address
    assert stop_worker(worker, timeout_s=30) == 0


class Client:
    """A bare DEALER speaking the wire protocol, as a render server would."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = make_dealer(self.context, endpoint, identity=uuid.uuid4().bytes)
        self.encoder = Encoder()
        self.decoder = WorkerMessageDecoder()

    def send(self, message: object) -> None:
        self.socket.send(self.encoder.encode(message))

    def poll(self, timeout_s: float) -> object | None:
        """The next message, or None if none arrives within `timeout_s`."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return self.decoder.decode(self.socket.recv())

    def recv(self, timeout_s: float = 30.0) -> object:
        message = self.poll(timeout_s)
        assert message is not None, "no message from the worker"
        return message

    def recv_until(self, kind: type, timeout_s: float = 30.0) -> object:
        def arrived() -> object | None:
            message = self.poll(0.1)
            return message if isinstance(message, kind) else None

        return wait_until(arrived, timeout_s, f"a {kind.__name__}", interval_s=0)

    def collect(self, request_id: str, timeout_s: float = 60.0) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []

        def finished() -> bool:
            message = self.poll(0.1)
            if isinstance(message, Deltas):
                mine = [d for d in message.deltas if d.request_id == request_id]
                deltas.extend(mine)
                return any(d.finish_reason for d in mine)
            if isinstance(message, Rejected) and message.request_id == request_id:
                raise AssertionError(f"rejected: {message}")
            return False

        wait_until(finished, timeout_s, f"request {request_id} to finish", interval_s=0)
        return deltas

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
def client(worker: str) -> Iterator[Client]:
    c = Client(worker)
    c.send(Hello(client_id="test"))
    welcome = c.recv_until(Welcome)
    assert welcome.model_card.vocab_size == 49152
    assert welcome.model_card.block_size == BLOCK_SIZE
    yield c
    c.close()


def _generate(
    request_id: str, max_tokens: int = 12, prompt: list[int] = PROMPT, **sampling: object
) -> Generate:
    return Generate(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
    )


def test_handshake_and_streamed_greedy_deltas(client: Client) -> None:
    client.send(_generate("a", prompt=CACHEABLE_PROMPT))
    deltas = client.collect("a")
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert 1 <= len(tokens) <= 12
    assert deltas[-1].finish_reason in ("stop", "length")
    assert deltas[-1].num_prompt_tokens == len(CACHEABLE_PROMPT)
    assert deltas[-1].num_cached_tokens == 0
    # Greedy is deterministic, and the second run hits the prefix cache: every full block
    # before its last prompt token (computed again for its logits).
    client.send(_generate("b", prompt=CACHEABLE_PROMPT))
    again = client.collect("b")
    assert [t for d in again for t in d.new_token_ids] == tokens
    full_blocks = (len(CACHEABLE_PROMPT) - 1) // BLOCK_SIZE
    assert again[-1].num_cached_tokens == full_blocks * BLOCK_SIZE == 32


def test_heartbeat_reports_idle_cache_after_abort(client: Client) -> None:
    client.send(_generate("long", max_tokens=400, ignore_eos=True))
    first = client.recv_until(Deltas)
    assert any(d.request_id == "long" for d in first.deltas)
    client.send(Abort(request_ids=["long"]))

    def idle() -> bool:
        stats = client.recv_until(Heartbeat).stats
        return stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total

    wait_until(idle, 10, "the KV blocks to be returned after the abort", interval_s=0)


def test_malformed_frames_are_dropped_and_counted(client: Client) -> None:
    for frame in (b"", b"garbage", MAGIC + bytes([99]) + b"\x80", MAGIC + b"\x01\xc1"):
        client.socket.send(frame)
    client.socket.send_multipart([b"two", b"frames"])
    client.send(_generate("after-garbage", max_tokens=4))
    assert client.collect("after-garbage")
    wait_until(
        lambda: client.recv_until(Heartbeat).stats.bad_frames >= 5,
        5,
        "the bad frames to be counted",
        interval_s=0,
    )


def test_invalid_requests_are_rejected_not_fatal(client: Client) -> None:
    client.send(
        Generate(request_id="oov", prompt_token_ids=[10**6], sampling=SamplingParams(max_tokens=2))
    )
    rejected = client.recv_until(Rejected)
    assert rejected.request_id == "oov"
    assert rejected.code == "invalid_request"
    client.send(
        Generate(request_id="too-long", prompt_token_ids=[5] * 9000, sampling=SamplingParams())
    )
    rejected = client.recv_until(Rejected)
    assert rejected.request_id == "too-long"
    assert rejected.code == "too_long"
    client.send(_generate("still-fine", max_tokens=3))
    assert client.collect("still-fine")


def test_generate_before_hello_is_rejected(worker: str) -> None:
    stranger = Client(worker)
    try:
        stranger.send(_generate("x"))
        rejected = stranger.recv_until(Rejected)
        assert rejected.code == "protocol"
    finally:
        stranger.close()


def test_fcfs_worker_refuses_a_priority_and_says_so_in_its_card(worker: str) -> None:
    c = Client(worker)
    try:
        c.send(Hello(client_id="test"))
        assert c.recv_until(Welcome).model_card.scheduling_policy == "fcfs"
        c.send(
            Generate(
                request_id="urgent", prompt_token_ids=PROMPT, sampling=SamplingParams(), priority=-1
            )
        )
        rejected = c.recv_until(Rejected)
        assert (rejected.request_id, rejected.code) == ("urgent", "invalid_request")
        assert "priority" in rejected.message
    finally:
        c.close()


def test_prompt_logprobs_arrive_on_the_first_delta(client: Client) -> None:
    client.send(_generate("prompt-lp", max_tokens=3, prompt_logprobs=2))
    deltas = client.collect("prompt-lp")
    # The worker acknowledges a request with an empty delta; the first token brings them.
    first_token = next(i for i, d in enumerate(deltas) if d.new_token_ids)
    first, rest = deltas[first_token], deltas[:first_token] + deltas[first_token + 1 :]
    entries = first.prompt_logprobs
    assert entries is not None
    assert len(entries) == len(PROMPT)
    assert entries[0] is None
    assert all(e is not None and e.logprob <= 0 and len(e.top_token_ids) == 2 for e in entries[1:])
    assert all(d.prompt_logprobs is None for d in rest)


@pytest.fixture(scope="module")
def priority_worker(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The tiny random Llama (fast steps), running one sequence at a time, by priority."""
    args = ["--model", str(tiny_llama_dir), "--scheduling-policy", "priority"]
    # Its log goes to a file: its word-level vocabulary has no structured outputs, which
    # the worker reports at startup with a traceback.
    log = tmp_path_factory.mktemp("priority-worker") / "gpu-worker.log"
    worker = start_worker(log, args, kv_cache_gb=0.01, max_num_seqs=1, heartbeat_interval_s=None)
    yield worker.address
    assert stop_worker(worker, timeout_s=30) == 0


def test_priority_decides_the_order_of_a_full_batch(priority_worker: str) -> None:
    c = Client(priority_worker)
    try:
        c.send(Hello(client_id="test"))
        assert c.recv_until(Welcome).model_card.scheduling_policy == "priority"

        def generate(request_id: str, priority: int, max_tokens: int) -> Generate:
            sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return Generate(
                request_id=request_id,
                prompt_token_ids=[5] * 8,
                sampling=sampling,
                priority=priority,
            )

        # It holds the only slot for its 240 steps while the others queue behind it.
        c.send(generate("running", 10, max_tokens=240))
        c.recv_until(Deltas)
        queued = [("p5", 5), ("p1", 1), ("p3", 3), ("p-2", -2), ("p1-later", 1)]
        for request_id, priority in queued:
            c.send(generate(request_id, priority, max_tokens=4))
        finished: list[str] = []

        def all_finished() -> bool:
            message = c.poll(0.1)
            if isinstance(message, Rejected):
                raise AssertionError(f"rejected: {message}")
            if isinstance(message, Deltas):
                finished.extend(d.request_id for d in message.deltas if d.finish_reason)
            return len(finished) == 6

        wait_until(all_finished, 60, "every request to finish", interval_s=0)
        assert finished == ["running", "p-2", "p1", "p1-later", "p3", "p5"]
    finally:
        c.close()


def test_duplicate_generate_runs_once(client: Client) -> None:
    client.send(_generate("dup", max_tokens=6, ignore_eos=True))
    client.send(_generate("dup", max_tokens=6, ignore_eos=True))
    deltas = client.collect("dup")
    assert sum(len(d.new_token_ids) for d in deltas) == 6
    # nothing more arrives for it (a window watched to its end, not a wait for something)
    window_ends = time.monotonic() + 1.5
    while time.monotonic() < window_ends:
        message = client.poll(0.1)
        if isinstance(message, Deltas):
            assert all(d.request_id != "dup" for d in message.deltas)
