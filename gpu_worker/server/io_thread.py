"""The worker's I/O thread: it owns the ROUTER socket, decodes what arrives and encodes and
sends what the engine loop hands it, so socket work overlaps the model's forward pass (ZMQ
and msgspec release the GIL). Heartbeats go out from here, so a long engine step never
looks like a dead worker.

When a client's pipe is full (ROUTER_MANDATORY raises EAGAIN), its deltas are merged per
request in its `Outbox` and retried, so no token is ever dropped.

Client liveness is tracked here too (`last_heard`), for the same reason: a render server
whose heartbeats keep arriving during a long step is alive, whatever the step's length.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from shared.protocol import (
    HEADER_BYTES,
    Deltas,
    Encoder,
    Heartbeat,
    Hello,
    LoRAResult,
    ProtocolError,
    Rejected,
    RenderMessageDecoder,
    RenderToWorker,
    RequestDelta,
    RequestId,
    Welcome,
    WorkerToRender,
    merge_delta,
)

logger = logging.getLogger(__name__)


class _GenerateId(msgspec.Struct, tag_field="type", tag="generate", kw_only=True):
    """Only the request id of a Generate (unknown fields ignored): what is left to answer
    when the rest of the message is invalid."""

    request_id: RequestId


_generate_id_decoder = msgspec.msgpack.Decoder(_GenerateId)


def salvage_request_id(frame: memoryview) -> str | None:
    """The request id of a Generate that failed to decode, if it has a readable one, so it
    can be refused instead of waiting for an answer that never comes."""
    try:
        return _generate_id_decoder.decode(frame[HEADER_BYTES:]).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


@dataclass
class ServerCounters:
    """What went wrong on the wire, for heartbeats and tests."""

    bad_frames: int = 0
    rejected: int = 0
    duplicates: int = 0
    send_retries: int = 0
    reaped_clients: int = 0


class Outbox:
    """Per-client messages waiting for the socket; Deltas coalesce per request."""

    def __init__(self) -> None:
        self.control: deque[Welcome | Heartbeat | Rejected | LoRAResult] = deque()
        self.deltas: dict[str, RequestDelta] = {}
        self.step = 0

    def add(self, message: WorkerToRender) -> None:
        if isinstance(message, Deltas):
            self.step = message.step
            for delta in message.deltas:
                pending = self.deltas.get(delta.request_id)
                if pending is None:
                    self.deltas[delta.request_id] = delta
                else:
                    merge_delta(pending, delta)
        elif (
            isinstance(message, Heartbeat)
            and self.control
            and isinstance(self.control[-1], Heartbeat)
        ):
            self.control[-1] = message  # a client that is not reading needs only the latest
        else:
            self.control.append(message)

    def is_empty(self) -> bool:
        return not self.control and not self.deltas


class IoThread(threading.Thread):
    """Owns the ROUTER socket; everything crossing threads goes through queues."""

    def __init__(
        self,
        context: zmq.Context,
        router: zmq.Socket,
        inbound: queue.Queue[tuple[bytes, RenderToWorker] | tuple[bytes, None]],
        counters: ServerCounters,
        heartbeat_interval_s: float,
        stall_limit_s: float,
    ) -> None:
        super().__init__(name="duet-worker-io", daemon=True)
        self._heartbeat_interval_s = heartbeat_interval_s
        self._stall_limit_s = stall_limit_s
        self._router = router
        self._inbound = inbound
        self._counters = counters
        self._outbound: queue.SimpleQueue[tuple[bytes, WorkerToRender]] = queue.SimpleQueue()
        self._wake_address = f"inproc://duet-wake-{id(self)}"
        self._wake_pull = context.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_address)
        self._wake_push = context.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_address)
        self._stopping = threading.Event()
        self._outboxes: dict[bytes, Outbox] = {}
        self.heartbeat: Heartbeat | None = None
        """Latest heartbeat the main thread published; sent to every client each second."""
        self.loop_alive_at = time.monotonic()
        """When the main loop last finished an iteration (a hung engine stops heartbeats)."""
        self._clients: set[bytes] = set()
        self.last_heard: dict[bytes, float] = {}
        """Monotonic time of each client's latest frame, stamped on arrival (this thread);
        the main thread reads it to reap silent clients and pops the ones it forgets."""

    def send(self, identity: bytes, message: WorkerToRender) -> None:
        """Queue a message for a client; called from the main thread only."""
        self._outbound.put((identity, message))
        self._wake_push.send(b"", zmq.NOBLOCK)

    def stop(self) -> None:
        self._stopping.set()
        self._wake_push.send(b"", zmq.NOBLOCK)

    def run(self) -> None:
        decoder = RenderMessageDecoder()
        encoder = Encoder()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                self._queue_heartbeats(now)
                next_heartbeat = now + self._heartbeat_interval_s
            has_backlog = any(not box.is_empty() for box in self._outboxes.values())
            wait_ms = 5 if has_backlog else int(1000 * max(0.0, next_heartbeat - now)) + 1
            events = dict(poller.poll(wait_ms))
            if self._wake_pull in events:
                while self._drain_one(self._wake_pull):
                    pass
            if self._router in events:
                self._receive(decoder)
            self._flush(encoder)
        self._wake_pull.close()
        self._wake_push.close()

    def _queue_heartbeats(self, now: float) -> None:
        # Sent from this thread so a long engine step (a big prefill on CPU) never looks
        # like a dead worker; a main loop stuck past the stall limit stops them, so a hung
        # engine still does. SIGSTOP stops this thread too.
        heartbeat = self.heartbeat
        if heartbeat is None or now - self.loop_alive_at > self._stall_limit_s:
            return
        heartbeat = Heartbeat(sent_at=time.time(), stats=heartbeat.stats)
        for identity in self._clients:
            self._outboxes.setdefault(identity, Outbox()).add(heartbeat)

    @staticmethod
    def _drain_one(socket: zmq.Socket) -> bool:
        try:
            socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _receive(self, decoder: RenderMessageDecoder) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._counters.bad_frames += 1
                continue
            identity = frames[0].bytes
            self.last_heard[identity] = time.monotonic()
            try:
                message = decoder.decode(frames[1].buffer)
            except ProtocolError as exc:
                self._counters.bad_frames += 1
                logger.warning("dropped a bad frame from %s: %s", identity.hex(), exc)
                request_id = salvage_request_id(frames[1].buffer)
                if request_id is not None:
                    refusal = Rejected(
                        request_id=request_id, code="invalid_request", message=str(exc)[:4096]
                    )
                    self._outboxes.setdefault(identity, Outbox()).add(refusal)
                continue
            if isinstance(message, Hello):
                self._clients.add(identity)
            self._inbound.put((identity, message))

    def _flush(self, encoder: Encoder) -> None:
        while True:
            try:
                identity, message = self._outbound.get_nowait()
            except queue.Empty:
                break
            self._outboxes.setdefault(identity, Outbox()).add(message)
        for identity in list(self._outboxes):
            box = self._outboxes[identity]
            try:
                # Deltas before control messages: a Rejected that ends a request (its
                # client was reaped) must not overtake that request's last tokens.
                if box.deltas:
                    message = Deltas(deltas=list(box.deltas.values()), step=box.step)
                    self._router.send_multipart([identity, encoder.encode(message)], zmq.NOBLOCK)
                    box.deltas.clear()
                while box.control:
                    self._router.send_multipart(
                        [identity, encoder.encode(box.control[0])], zmq.NOBLOCK
                    )
                    box.control.popleft()
            except zmq.Again:
                self._counters.send_retries += 1
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # The peer is gone: nothing will read these; tell the main thread.
                del self._outboxes[identity]
                self._clients.discard(identity)
                self._inbound.put((identity, None))
            else:
                if box.is_empty():
                    del self._outboxes[identity]
