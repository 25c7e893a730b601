"""The worker's ZMQ loop: an I/O thread beside a busy engine loop.

The I/O thread (`gpu_worker.server.io_thread`) owns the ROUTER socket. The main thread
here drains the messages it decoded, then steps the engine, and hands one `Deltas` per
connected client per step back to it. Client bookkeeping (Hello, duplicates, aborts of a
client that went silent) lives here, on the main thread, beside the engine it touches.

Every accepted request is acknowledged at once with an empty delta, so a render server
can hold its HTTP answer until the request is either running here or refused. A client
reaped for silence gets a `Rejected` ("protocol") for each request it loses: if it was
only paused, it greets again and resends them; nothing ends without an answer.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import zmq

from gpu_worker.engine.errors import RequestRejected
from gpu_worker.server.io_thread import IoThread, ServerCounters
from shared.curve import start_authenticator, worker_keys
from shared.model_card import ModelCard
from shared.protocol import (
    Abort,
    ClientHeartbeat,
    Deltas,
    Generate,
    Heartbeat,
    Hello,
    LoadLoRA,
    LoRAResult,
    RejectCode,
    Rejected,
    RenderToWorker,
    RequestDelta,
    UnloadLoRA,
    Welcome,
    WorkerStats,
)
from shared.transport import bound_endpoint, make_router

if TYPE_CHECKING:
    from gpu_worker.runner.device import GpuReading
    from gpu_worker.server.kv_events import KVEventPublisher
    from gpu_worker.server.metrics_http import WorkerMetrics

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What the server needs from the engine (`gpu_worker.engine.engine.Engine` provides it)."""

    model_card: ModelCard

    def add_request(self, request: Generate, request_key: str) -> None: ...
    def abort(self, request_keys: list[str]) -> None: ...
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> WorkerStats: ...
    def load_lora(self, name: str, path: str) -> LoRAOutcome: ...
    def unload_lora(self, name: str) -> LoRAOutcome: ...


class LoRAOutcome(Protocol):
    """How a LoRA load or unload went (`gpu_worker.engine.engine.LoRAOpResult`)."""

    @property
    def status(self) -> int: ...
    @property
    def message(self) -> str: ...
    @property
    def ok(self) -> bool: ...


class GpuReader(Protocol):
    """A source of GPU memory and utilization samples (gpu_worker.runner.device.Nvml)."""

    def read(self) -> GpuReading: ...


@dataclass
class _Client:
    identity: bytes
    number: int
    joined_at: float
    request_ids: set[str] = field(default_factory=set)
    sends_heartbeats: bool = False
    """It has sent a ClientHeartbeat, so its silence means it is gone."""


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
        metrics: WorkerMetrics | None = None,
        kv_events: KVEventPublisher | None = None,
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
        self._io = IoThread(
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
        self._metrics = metrics
        self._kv_events = kv_events
        """Optional, set up by the caller; this loop feeds them and closes the publisher."""
        self._clients: dict[bytes, _Client] = {}
        self._client_numbers = itertools.count()
        # engine key -> (client identity, request id as the client knows it)
        self._owners: dict[str, tuple[bytes, str]] = {}
        self._stop = threading.Event()
        self._step = 0
        self._acks: dict[bytes, list[RequestDelta]] = {}
        """Empty deltas acknowledging the requests accepted in this drain, per client."""

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
                    deltas = self.engine.step()
                    if self._kv_events is not None:
                        # Before the replies: a router reading the events knows these
                        # blocks before a client can send the follow-up that reuses them.
                        self._kv_events.publish_pending()
                    if self._metrics is not None:
                        self._metrics.observe_deltas(deltas)
                    self._send_deltas(deltas)
                if self._metrics is not None:
                    self._metrics.observe_stats(self.engine.stats())
                now = time.monotonic()
                self._io.loop_alive_at = now
                if now >= next_stats:
                    self._publish_stats()
                    self._reap_silent_clients(now)
                    next_stats = now + self._heartbeat_interval_s / 2
        finally:
            self._io.stop()
            self._io.join(timeout=5)
            if self._kv_events is not None:
                self._kv_events.close()
            self._router.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()

    def _reap_silent_clients(self, now: float) -> None:
        """Free the requests of render processes that stopped heartbeating (killed, or
        partitioned away), so their KV blocks do not leak. Silence is measured from the
        frames the I/O thread received, so a long engine step never looks like it."""
        last_heard = self._io.last_heard
        for client in list(self._clients.values()):
            silent_s = now - last_heard.get(client.identity, client.joined_at)
            if client.sends_heartbeats and silent_s > self._client_timeout_s:
                logger.warning(
                    "render client %d silent for %.1fs: aborting its %d requests",
                    client.number,
                    silent_s,
                    len(client.request_ids),
                )
                self.counters.reaped_clients += 1
                self._forget_client(
                    client.identity,
                    notice=f"render client silent for {silent_s:.1f}s: the request was "
                    "aborted; send Hello and resend it",
                )

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
                break
        for identity, acks in self._acks.items():
            self._io.send(identity, Deltas(deltas=acks, step=self._step))
        self._acks.clear()

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
                self._io.last_heard[identity] = client.joined_at
            self._io.send(
                identity,
                Welcome(worker_id=self.worker_id, model_card=self.engine.model_card),
            )
            return
        if client is None:
            self._refuse_stranger(identity, message)
            return
        if isinstance(message, Generate):
            self._add(client, message)
        elif isinstance(message, Abort):
            keys = [self._key(client, rid) for rid in message.request_ids]
            keys = [key for key in keys if key in self._owners]
            for key in keys:
                client.request_ids.discard(self._owners.pop(key)[1])
            if keys:
                self._abort(keys)
        elif isinstance(message, ClientHeartbeat):
            client.sends_heartbeats = True
        elif isinstance(message, LoadLoRA | UnloadLoRA):
            self._change_lora(identity, message)

    def _change_lora(self, identity: bytes, message: LoadLoRA | UnloadLoRA) -> None:
        """Register or forget an adapter, here between steps on the engine's thread, and
        answer with the outcome: a bad path or adapter is an answer, never a crash."""
        if isinstance(message, LoadLoRA):
            outcome = self.engine.load_lora(message.lora_name, message.lora_path)
        else:
            outcome = self.engine.unload_lora(message.lora_name)
        if not outcome.ok:
            verb = "load" if isinstance(message, LoadLoRA) else "unload"
            logger.info("LoRA %s of %s refused: %s", verb, message.lora_name, outcome.message)
        result = LoRAResult(
            op_id=message.op_id,
            ok=outcome.ok,
            status=outcome.status,
            message=outcome.message[:4096],
        )
        self._io.send(identity, result)

    def _refuse_stranger(self, identity: bytes, message: RenderToWorker) -> None:
        """Answer what a client that never said Hello asked for, so it never waits."""
        self.counters.rejected += 1
        if isinstance(message, Generate):
            self._reject(identity, message.request_id, "protocol", "send Hello first")
        elif isinstance(message, LoadLoRA | UnloadLoRA):
            refused = LoRAResult(
                op_id=message.op_id, ok=False, status=400, message="send Hello first"
            )
            self._io.send(identity, refused)

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
        ack = RequestDelta(request_id=request.request_id, new_token_ids=[])
        self._acks.setdefault(client.identity, []).append(ack)

    def _abort(self, keys: list[str]) -> None:
        self.engine.abort(keys)
        if self._metrics is not None:
            self._metrics.observe_aborts(len(keys))

    def _reject(self, identity: bytes, request_id: str, code: RejectCode, message: str) -> None:
        self._io.send(identity, Rejected(request_id=request_id, code=code, message=message))

    def _forget_client(self, identity: bytes, notice: str | None = None) -> None:
        """Abort a client's requests and forget it; with a `notice`, tell it which
        requests were lost (it may only have been paused, and will resend them)."""
        client = self._clients.pop(identity, None)
        self._io.last_heard.pop(identity, None)
        self._acks.pop(identity, None)
        if client is None:
            return
        keys = [self._key(client, rid) for rid in client.request_ids]
        for key in keys:
            self._owners.pop(key, None)
        if keys:
            self._abort(keys)
        if notice is not None:
            for request_id in client.request_ids:
                self._reject(identity, request_id, "protocol", notice)

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
