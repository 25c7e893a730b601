"""The worker's ZMQ loop: an I/O thread beside a busy engine loop.

The I/O thread owns the ROUTER socket: it receives and decodes frames, and encodes and
sends replies. The main thread drains decoded messages, then steps the engine, and
hands one `Deltas` per connected client per step back to the I/O thread. ZMQ and
msgspec release the GIL, so the socket work overlaps the model's forward pass.

When a client's pipe is full (ROUTER_MANDATORY raises EAGAIN), its deltas are merged
per request and retried, so no token is ever dropped.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import zmq

from gpu_worker.engine.errors import RequestRejected
from shared.curve import start_authenticator, worker_keys
from shared.model_card import ModelCard
from shared.protocol import (
    Abort,
    ClientHeartbeat,
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    ProtocolError,
    RejectCode,
    Rejected,
    RenderMessageDecoder,
    RenderToWorker,
    RequestDelta,
    Welcome,
    WorkerStats,
    WorkerToRender,
    merge_delta,
)
from shared.transport import bound_endpoint, make_router

if TYPE_CHECKING:
    from gpu_worker.runner.device import GpuReading

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What the server needs from the engine (`gpu_worker.engine.engine.Engine` provides it)."""

    model_card: ModelCard

    def add_request(self, request: Generate, request_key: str) -> None: ...
    def abort(self, request_keys: list[str]) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> WorkerStats: ...


class GpuReader(Protocol):
    """A source of GPU memory and utilization samples (gpu_worker.runner.device.Nvml)."""

    def read(self) -> GpuReading: ...


@dataclass
class ServerCounters:
    """What went wrong on the wire, for heartbeats and tests."""

    bad_frames: int = 0
    rejected: int = 0
    duplicates: int = 0
    send_retries: int = 0
    reaped_clients: int = 0


@dataclass
class _Client:
    identity: bytes
    number: int
    last_seen: float
    request_ids: set[str] = field(default_factory=set)
    sends_heartbeats: bool = False
    """It has sent a ClientHeartbeat, so its silence means it is gone."""


class _Outbox:
    """Per-client messages waiting for the socket; Deltas coalesce per request."""

    def __init__(self) -> None:
        self.control: deque[Welcome | Heartbeat | Rejected] = deque()
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


class _IoThread(threading.Thread):
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
        self._outboxes: dict[bytes, _Outbox] = {}
        self.heartbeat: Heartbeat | None = None
        """Latest heartbeat the main thread published; sent to every client each second."""
        self.loop_alive_at = time.monotonic()
        """When the main loop last finished an iteration (a hung engine stops heartbeats)."""
        self._clients: set[bytes] = set()

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
            self._outboxes.setdefault(identity, _Outbox()).add(heartbeat)

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
            try:
                message = decoder.decode(frames[1].buffer)
            except ProtocolError as exc:
                self._counters.bad_frames += 1
                logger.warning("dropped a bad frame from %s: %s", identity.hex(), exc)
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
            self._outboxes.setdefault(identity, _Outbox()).add(message)
        for identity in list(self._outboxes):
            box = self._outboxes[identity]
            try:
                while box.control:
                    self._router.send_multipart(
                        [identity, encoder.encode(box.control[0])], zmq.NOBLOCK
                    )
                    box.control.popleft()
                if box.deltas:
                    message = Deltas(deltas=list(box.deltas.values()), step=box.step)
                    self._router.send_multipart([identity, encoder.encode(message)], zmq.NOBLOCK)
                    box.deltas.clear()
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


class WorkerServer:
    """Runs the engine behind a ROUTER socket until `stop()`."""

    def __init__(
        self,
        engine: EngineCore,
        bind: str,
        *,
        worker_id: str = "worker",
        curve_dir: Path | None = None,
        heartbeat_interval_s: float = 1.0,
        stall_limit_s: float = 60.0,
        client_timeout_s: float = 10.0,
        gpu_reader: GpuReader | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.counters = ServerCounters()
        self._context = zmq.Context()
        self._authenticator = None
        curve = None
        if curve_dir is not None:
            # The ZAP handler must run before the socket binds, or early peers skip it.
            self._authenticator = start_authenticator(self._context, curve_dir)
            curve = worker_keys(curve_dir)
        self._router = make_router(self._context, bind, curve=curve)
        self.endpoint = bound_endpoint(self._router)
        self._inbound: queue.Queue = queue.Queue()
        self._io = _IoThread(
            self._context,
            self._router,
            self._inbound,
            self.counters,
            heartbeat_interval_s,
            stall_limit_s,
        )
        self._heartbeat_interval_s = heartbeat_interval_s
        self._client_timeout_s = client_timeout_s
        self._gpu_reader = gpu_reader
        self._clients: dict[bytes, _Client] = {}
        self._client_numbers = itertools.count()
        # engine key -> (client identity, request id as the client knows it)
        self._owners: dict[str, tuple[bytes, str]] = {}
        self._stop = threading.Event()
        self._step = 0

    def stop(self) -> None:
        self._stop.set()
        self._inbound.put((b"", None))

    def serve_forever(self) -> None:
        self._io.start()
        next_stats = time.monotonic()
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                timeout = 0.0 if busy else max(0.0, next_stats - time.monotonic())
                self._drain_inbound(block_for=timeout)
                if self.engine.has_unfinished_requests():
                    self._send_deltas(self.engine.step())
                now = time.monotonic()
                self._io.loop_alive_at = now
                if now >= next_stats:
                    self._publish_stats()
                    self._reap_silent_clients(now)
                    next_stats = now + self._heartbeat_interval_s / 2
        finally:
            self._io.stop()
            self._io.join(timeout=5)
            self._router.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()

    def _reap_silent_clients(self, now: float) -> None:
        """Free the requests of render processes that stopped heartbeating (killed, or
        partitioned away), so their KV blocks do not leak."""
        for client in list(self._clients.values()):
            if client.sends_heartbeats and now - client.last_seen > self._client_timeout_s:
                logger.warning(
                    "render client %d silent for %.1fs: aborting its %d requests",
                    client.number,
                    now - client.last_seen,
                    len(client.request_ids),
                )
                self.counters.reaped_clients += 1
                self._forget_client(client.identity)

    def _drain_inbound(self, block_for: float) -> None:
        try:
            item = self._inbound.get(timeout=block_for) if block_for > 0 else None
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._handle(*item)
            try:
                item = self._inbound.get_nowait()
            except queue.Empty:
                return

    def _handle(self, identity: bytes, message: RenderToWorker | None) -> None:
        if message is None:
            if identity:
                self._forget_client(identity)
            return
        client = self._clients.get(identity)
        if isinstance(message, Hello):
            if client is None:
                client = _Client(identity, next(self._client_numbers), time.monotonic())
                self._clients[identity] = client
            self._io.send(
                identity,
                Welcome(worker_id=self.worker_id, model_card=self.engine.model_card),
            )
            return
        if client is None:
            self.counters.rejected += 1
            if isinstance(message, Generate):
                self._reject(identity, message.request_id, "protocol", "send Hello first")
            return
        client.last_seen = time.monotonic()
        if isinstance(message, Generate):
            self._add(client, message)
        elif isinstance(message, Abort):
            keys = [self._key(client, rid) for rid in message.request_ids]
            keys = [key for key in keys if key in self._owners]
            for key in keys:
                client.request_ids.discard(self._owners.pop(key)[1])
            if keys:
                self.engine.abort(keys)
        elif isinstance(message, ClientHeartbeat):
            client.sends_heartbeats = True

    @staticmethod
    def _key(client: _Client, request_id: str) -> str:
        return f"{client.number}/{request_id}"

    def _add(self, client: _Client, request: Generate) -> None:
        key = self._key(client, request.request_id)
        try:
            self.engine.add_request(request, key)  # the one check of a request, duplicates too
        except RequestRejected as exc:
            if exc.code == "duplicate":
                self.counters.duplicates += 1  # a retried Generate runs once, unanswered
                return
            self.counters.rejected += 1
            self._reject(client.identity, request.request_id, exc.code, exc.message)
            return
        self._owners[key] = (client.identity, request.request_id)
        client.request_ids.add(request.request_id)

    def _reject(self, identity: bytes, request_id: str, code: RejectCode, message: str) -> None:
        self._io.send(identity, Rejected(request_id=request_id, code=code, message=message))

    def _forget_client(self, identity: bytes) -> None:
        client = self._clients.pop(identity, None)
        if client is None:
            return
        keys = [self._key(client, rid) for rid in client.request_ids]
        for key in keys:
            self._owners.pop(key, None)
        if keys:
            self.engine.abort(keys)

    def _send_deltas(self, deltas: list[RequestDelta]) -> None:
        self._step += 1
        by_client: dict[bytes, list[RequestDelta]] = {}
        for delta in deltas:
            key = delta.request_id
            owner = self._owners.get(key)
            if owner is None:
                continue  # aborted while in flight
            identity, client_request_id = owner
            delta.request_id = client_request_id
            by_client.setdefault(identity, []).append(delta)
            if delta.finish_reason is not None:
                del self._owners[key]
                client = self._clients.get(identity)
                if client is not None:
                    client.request_ids.discard(client_request_id)
        for identity, client_deltas in by_client.items():
            self._io.send(identity, Deltas(deltas=client_deltas, step=self._step))

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        if self._gpu_reader is not None:
            reading = self._gpu_reader.read()
            stats.gpu_memory_used_bytes = reading.memory_used_bytes
            stats.gpu_memory_total_bytes = reading.memory_total_bytes
            stats.gpu_utilization = reading.utilization
        stats.bad_frames = self.counters.bad_frames
        # One reference swap: the I/O thread reads whichever heartbeat is current.
        self._io.heartbeat = Heartbeat(sent_at=time.time(), stats=stats)
