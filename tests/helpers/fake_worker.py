"""A fake gpu-worker: the worker's side of the ZMQ wire without an engine, for the render tier.

`FakeWorker` is the worker's own socket (`shared.transport.make_router`) served by a thread.
It welcomes each Hello with its model card, heartbeats every client it has heard from,
records every message it receives and sends what a test queues. A subclass answers more
through `reply` and reports its own `stats`; `noise` turns it into a source of garbage.
Entering it starts it; leaving stops it and closes its socket (`fake_workers` for several).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Self

import zmq

from shared.model_card import ModelCard
from shared.protocol import (
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    ProtocolError,
    RenderMessageDecoder,
    RenderToWorker,
    Welcome,
    WorkerStats,
    WorkerToRender,
)
from shared.transport import bound_endpoint, make_router

FAKE_CARD = ModelCard(
    model_id="fake",
    tokenizer_digest="f" * 64,
    vocab_size=1000,
    eos_token_ids=[2],
    max_model_len=4096,
)
"""The card a `FakeWorker` welcomes with unless given another: a pool opened with its
tokenizer_digest accepts it."""

Frames = list[bytes]


class FakeWorker(threading.Thread):
    """A worker that answers the handshake and heartbeats, and otherwise does what the test
    says: `send` and `send_raw` queue messages for every client, `received` holds what the
    clients sent.

    - `card`: the Welcome's model card; None never welcomes (an impostor, a garbage source).
    - `heartbeat_interval_s`: None sends no heartbeats.
    - `before_welcome`: raw messages sent ahead of the first Welcome (garbage to survive).
    - `noise`: a raw message sent to every client on every turn of the loop, a few hundred
      a second.
    """

    def __init__(
        self,
        card: ModelCard | None = FAKE_CARD,
        *,
        bind: str = "tcp://127.0.0.1:*",
        heartbeat_interval_s: float | None = 0.2,
        before_welcome: Sequence[Frames] = (),
        noise: Callable[[], Frames] | None = None,
    ) -> None:
        super().__init__(daemon=True, name="fake-worker")
        self.card = card
        self.heartbeat_interval_s = heartbeat_interval_s
        self.noise = noise
        self._before_welcome = list(before_welcome)
        self._context = zmq.Context()
        self._router = make_router(self._context, bind)
        self.endpoint = bound_endpoint(self._router)
        self.received: list[RenderToWorker | Frames] = []
        """Every message from a client, in order: decoded, or its frames where they do not
        decode (or are more than one)."""
        self.peers: list[bytes] = []
        """The clients heard from and still reachable, by socket identity."""
        self.sent = 0
        """Messages sent to a client: welcomes, heartbeats, replies, queued and noise."""
        self._outbox: queue.Queue[Frames] = queue.Queue()
        self._stopping = threading.Event()

    # ---- what a subclass may change ----------------------------------------------------

    def reply(self, message: RenderToWorker) -> WorkerToRender | None:
        """The answer to a message other than Hello, sent to its sender; None for none."""
        return None

    def stats(self) -> WorkerStats:
        """What each heartbeat reports."""
        return WorkerStats()

    # ---- what a test reads and does ----------------------------------------------------

    @property
    def generates(self) -> list[Generate]:
        """The Generates received, in order."""
        return [message for message in self.received if isinstance(message, Generate)]

    @property
    def request_ids(self) -> list[str]:
        """The request ids of the Generates received, in order."""
        return [generate.request_id for generate in self.generates]

    def send(self, message: WorkerToRender) -> None:
        """Queue a wire message for every client (from any thread)."""
        self._outbox.put([Encoder().encode(message)])

    def send_raw(self, frames: Frames) -> None:
        """Queue raw frames, one multipart message, for every client (from any thread)."""
        self._outbox.put(frames)

    def stop(self) -> None:
        """End the loop, which closes the socket; waits for the thread (5 s at most)."""
        self._stopping.set()
        self.join(timeout=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        decoder = RenderMessageDecoder()
        encoder = Encoder()
        next_beat = 0.0
        # A noise source turns fast: each turn is one message to every client.
        poll_ms = 2 if self.noise is not None else 10
        while not self._stopping.is_set():
            if self._router.poll(poll_ms):
                peer, *frames = self._router.recv_multipart()
                self._receive(peer, _decode(decoder, frames), encoder)
            if not self.peers:
                continue
            while not self._outbox.empty():
                self._broadcast(self._outbox.get())
            if self.noise is not None:
                for peer in list(self.peers):
                    self._send(peer, self.noise())
            if self.heartbeat_interval_s is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_interval_s
                beat = Heartbeat(sent_at=time.time(), stats=self.stats())
                self._broadcast([encoder.encode(beat)])
        self._router.close(linger=0)
        self._context.term()

    def _receive(self, peer: bytes, message: RenderToWorker | Frames, encoder: Encoder) -> None:
        if peer not in self.peers:
            self.peers.append(peer)
        self.received.append(message)
        if isinstance(message, list):
            return
        if not isinstance(message, Hello):
            if (answer := self.reply(message)) is not None:
                self._send(peer, [encoder.encode(answer)])
        elif self.card is not None:
            for raw in self._before_welcome:
                self._send(peer, raw)
            self._before_welcome = []
            welcome = Welcome(worker_id="fake", model_card=self.card)
            self._send(peer, [encoder.encode(welcome)])

    def _broadcast(self, frames: Frames) -> None:
        for peer in list(self.peers):
            self._send(peer, frames)

    def _send(self, peer: bytes, frames: Frames) -> None:
        """Send without blocking: a full pipe drops the message, a client gone (the socket
        is ROUTER_MANDATORY, as the worker's) is forgotten."""
        try:
            self._router.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.peers.remove(peer)
            return
        self.sent += 1


@contextlib.contextmanager
def fake_workers(*workers: FakeWorker) -> Iterator[tuple[FakeWorker, ...]]:
    """Run several fake workers for the block, stopped at its end whatever happens."""
    with contextlib.ExitStack() as stack:
        for worker in workers:
            stack.enter_context(worker)
        yield workers


def _decode(decoder: RenderMessageDecoder, frames: Frames) -> RenderToWorker | Frames:
    if len(frames) != 1:
        return frames
    try:
        return decoder.decode(frames[0])
    except ProtocolError:
        return frames
