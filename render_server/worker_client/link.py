"""One DEALER socket to one gpu-worker, driven from the asyncio loop, and what the pool
knows about that worker.

The socket's file descriptor is watched with `loop.add_reader`; `_drain` reads every queued
frame and hands it to the pool's callback. Sends never block: a full pipe keeps frames in
order in a backlog. The socket monitor reports a dropped connection at once.

The link owns the worker's state (welcomed, refused, alive, draining, its streams, its last
figures); the pool changes it only through the link's methods, which name the transitions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from render_server.worker_client.request_stream import RequestStream, WorkerError, WorkerErrorCode
from render_server.worker_client.routing import AdapterPresence, WorkerLoad
from shared.model_card import ModelCard
from shared.protocol import MAX_BATCH, Abort, RenderToWorker, WorkerStats

logger = logging.getLogger(__name__)

# Frames handled per wake-up of one socket before yielding to the loop, so a flood from
# one worker cannot starve HTTP writes.
_MAX_FRAMES_PER_WAKEUP = 256
# How long closing waits for queued Aborts to reach the workers.
_CLOSE_LINGER_MS = 500


@dataclass
class WorkerStatus:
    """What the pool knows about one worker, for /ready, admin pages and tests."""

    address: str
    worker_id: str | None
    model_card: ModelCard | None
    connected: bool
    """The worker answered Hello with an acceptable card."""
    alive: bool
    """Its messages arrive: connected and heard from within heartbeat_timeout_s."""
    last_heartbeat: float
    """Wall-clock time of its last Heartbeat (0 before the first)."""
    stats: WorkerStats | None
    outstanding: int
    """Requests of this render process in flight on it."""
    refused: bool = False
    """Its card does not match our tokenizer (or model id); it is never routed to."""
    draining: bool = False
    """Removed from the pool's addresses: no new requests; closed once its streams end."""
    in_flight_adapters: frozenset[str] = field(default_factory=frozenset)
    """The LoRA adapters of this process's requests on it."""


class WorkerLink:
    """One DEALER to one worker, and what the pool has learned about that worker: the
    link's methods are the only way that knowledge changes."""

    def __init__(
        self,
        address: str,
        socket: zmq.Socket,
        loop: asyncio.AbstractEventLoop,
        *,
        encode: Callable[[RenderToWorker], bytes],
        on_frames: Callable[[WorkerLink, list[bytes]], None],
        on_disconnect: Callable[[WorkerLink], None],
    ) -> None:
        self.address = address
        self.socket = socket
        self._worker_id: str | None = None
        self._model_card: ModelCard | None = None
        self._welcomed = False
        self._refused = False
        self._alive = False
        self._last_seen = 0.0  # monotonic time of its last frame of any kind
        self._last_heartbeat = 0.0
        self._hello_sent_at = 0.0  # monotonic
        self._stats: WorkerStats | None = None
        # Adapters this worker loaded (True) or unloaded (False) by our request that its
        # heartbeats do not show yet: one sent before the change must not undo it.
        self._adapter_changes: dict[str, bool] = {}
        self._streams: dict[str, RequestStream] = {}
        self._closed = False
        self._draining = False
        self._encode = encode
        self._on_frames = on_frames
        self._on_disconnect = on_disconnect
        self._loop = loop
        # Frames the full pipe refused, in order; retried every heartbeat round (the pipe
        # only fills when the worker stops reading, i.e. it is about to be marked dead).
        self._backlog: deque[bytes] = deque()
        self._aborts: list[str] = []
        self._drain_scheduled = False
        self._fd = socket.fileno()
        loop.add_reader(self._fd, self._drain)
        # A dropped connection (the worker process died) is known at once from the socket's
        # monitor; heartbeats still catch a worker that hangs with its socket open.
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_fd = self._monitor.fileno()
        loop.add_reader(self._monitor_fd, self._on_monitor)

    # ---- what the pool knows ----------------------------------------------------------

    @property
    def welcomed(self) -> bool:
        """The worker answered Hello with a card we accept."""
        return self._welcomed

    @property
    def refused(self) -> bool:
        """Its card does not match ours; it is never routed to."""
        return self._refused

    @property
    def alive(self) -> bool:
        """Welcomed and heard from within the pool's heartbeat timeout."""
        return self._alive

    @property
    def draining(self) -> bool:
        """No longer in the pool's addresses: its streams finish, it takes nothing new."""
        return self._draining

    @property
    def stats(self) -> WorkerStats | None:
        """Its last heartbeat's figures, with the adapter changes it does not show yet."""
        return self._stats

    @property
    def streams(self) -> Mapping[str, RequestStream]:
        """This render process's requests in flight on the worker, by request id."""
        return self._streams

    @property
    def is_routable(self) -> bool:
        """New requests (and failed-over ones) may go here."""
        return self._welcomed and self._alive and not self._draining

    def seconds_silent(self, now: float) -> float:
        """Since its last frame of any kind (`now`: time.monotonic())."""
        return now - self._last_seen

    def seconds_since_hello(self, now: float) -> float:
        """Since we last sent it Hello (`now`: time.monotonic())."""
        return now - self._hello_sent_at

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            address=self.address,
            worker_id=self._worker_id,
            model_card=self._model_card,
            connected=self._welcomed,
            alive=self._alive,
            last_heartbeat=self._last_heartbeat,
            stats=self._stats,
            outstanding=len(self._streams),
            refused=self._refused,
            draining=self._draining,
            in_flight_adapters=frozenset(self.in_flight_adapters()),
        )

    def load(self, lora_name: str | None = None) -> WorkerLoad:
        """This worker as the router sees it for a request of `lora_name` (None: base)."""
        stats = self._stats
        if stats is None:
            return WorkerLoad(self.address, len(self._streams))
        adapter: AdapterPresence = "absent"
        if lora_name is not None:
            if lora_name in stats.lora_resident:
                adapter = "resident"
            elif lora_name in stats.lora_registered:
                adapter = "registered"
        return WorkerLoad(
            self.address, len(self._streams), stats.num_running, stats.num_waiting, adapter
        )

    def in_flight_adapters(self) -> set[str]:
        """The adapters of this render process's requests on the worker."""
        return {
            stream.request.lora_name
            for stream in self._streams.values()
            if stream.request.lora_name is not None
        }

    # ---- what the worker told us --------------------------------------------------------

    def heard_from(self) -> None:
        """A frame of any kind arrived from the worker."""
        self._last_seen = time.monotonic()

    def forgive_silence(self, now: float) -> None:
        """This process did not run until `now` (monotonic): the worker's silence until then
        says nothing about it, so its timeout starts afresh."""
        self._last_seen = max(self._last_seen, now)

    def accept(self, worker_id: str, card: ModelCard) -> None:
        """The worker welcomed us with a card we accept: it is alive and may be routed to."""
        self._refused = False
        self._worker_id = worker_id
        self._model_card = card
        self._welcomed = self._alive = True
        self._adapter_changes.clear()  # it may have restarted: its heartbeats say what it has

    def refuse(self) -> None:
        """The worker's card does not match ours: never route to it."""
        self._refused = True
        self._welcomed = self._alive = False

    def revive(self) -> bool:
        """A welcomed worker marked dead was heard from again: alive once more. Whether it
        was dead."""
        if self._welcomed and not self._alive:
            self._alive = True
            return True
        return False

    def mark_lost(self) -> None:
        """Silent past the timeout, or its connection dropped: not alive until heard from."""
        self._alive = False

    def take_heartbeat(self, stats: WorkerStats) -> None:
        """The worker's figures from a Heartbeat, with the adapter changes it does not show
        yet applied on top of them."""
        self._stats = stats
        if self._adapter_changes:
            self._apply_adapter_changes(heartbeat=True)
        self._last_heartbeat = time.time()

    def record_adapter_change(self, lora_name: str, loaded: bool) -> None:
        """The worker loaded (`loaded`) or unloaded adapter `lora_name` by our request: shown
        in `stats` at once and until a heartbeat shows it."""
        self._adapter_changes[lora_name] = loaded
        self._apply_adapter_changes(heartbeat=False)

    def _apply_adapter_changes(self, *, heartbeat: bool) -> None:
        """Patch `stats` with the changes its heartbeats do not show yet; a change a fresh
        heartbeat (`heartbeat`) shows is done with."""
        stats = self._stats
        if stats is None:
            return
        registered = list(stats.lora_registered)
        resident = list(stats.lora_resident)
        for name, loaded in list(self._adapter_changes.items()):
            if (name in registered) == loaded:
                if heartbeat:  # the worker's own figures show it now
                    del self._adapter_changes[name]
            elif loaded:
                registered.append(name)
            else:
                registered.remove(name)
                if name in resident:
                    resident.remove(name)
        self._stats = msgspec.structs.replace(
            stats, lora_registered=registered, lora_resident=resident
        )

    # ---- what the pool decided ----------------------------------------------------------

    def start_draining(self) -> None:
        """Removed from the pool's addresses: take nothing new; closed once its streams end."""
        self._draining = True

    def stop_draining(self) -> None:
        """Listed again: back in service."""
        self._draining = False

    def track(self, stream: RequestStream) -> None:
        """`stream`'s request was (or is about to be) sent here: its deltas come from here."""
        self._streams[stream.request_id] = stream

    def untrack(self, request_id: str) -> RequestStream | None:
        """Stop routing the request's deltas to its stream (it finished, or goes elsewhere);
        the stream, if it was tracked."""
        return self._streams.pop(request_id, None)

    def fail_streams(self, code: WorkerErrorCode, message: str) -> None:
        """Abort every request in flight here and end each stream with that error."""
        for stream in list(self._streams.values()):
            # Aborted now so a worker that resumes frees their KV blocks at once.
            self.abort(stream.request_id)
            stream.fail(WorkerError(code, message))

    # ---- the socket ---------------------------------------------------------------------

    def say_hello(self, hello: bytes) -> None:
        """Send the encoded `Hello`, remembering when (it is re-sent while unanswered)."""
        self._hello_sent_at = time.monotonic()
        self.send_frame(hello)

    def send(self, message: RenderToWorker) -> None:
        self.send_frame(self._encode(message))

    def send_frame(self, frame: bytes) -> None:
        if self._closed:
            return
        if self._backlog:
            self._backlog.append(frame)  # keep the order: an Abort never overtakes its Generate
        else:
            try:
                self.socket.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                self._backlog.append(frame)
        self._poke()

    def flush_backlog(self) -> None:
        while self._backlog and not self._closed:
            try:
                self.socket.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()
        self._poke()

    def abort(self, request_id: str) -> None:
        """Forget the request and queue an Abort; all aborts of one loop turn go together."""
        self._streams.pop(request_id, None)
        if self._closed:
            return
        self._aborts.append(request_id)
        if len(self._aborts) == 1:
            self._loop.call_soon(self.flush_aborts)

    def flush_aborts(self) -> None:
        while self._aborts:
            batch, self._aborts = self._aborts[:MAX_BATCH], self._aborts[MAX_BATCH:]
            self.send(Abort(request_ids=batch))

    def close(self) -> None:
        if self._closed:
            return
        self.flush_aborts()
        self._closed = True
        self._loop.remove_reader(self._fd)
        self._loop.remove_reader(self._monitor_fd)
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=_CLOSE_LINGER_MS)

    def _on_monitor(self) -> None:
        disconnected = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            disconnected |= event["event"] == zmq.EVENT_DISCONNECTED
        if disconnected and self._alive and not self._closed:
            self._on_disconnect(self)

    def _poke(self) -> None:
        # ZMQ's FD only signals "look at EVENTS", and any send may consume that signal
        # for a frame that arrived meanwhile; check ourselves so it is never stranded.
        if (
            not self._drain_scheduled
            and not self._closed
            and cast(int, self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        ):
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        socket = self.socket
        on_frames = self._on_frames
        for _ in range(_MAX_FRAMES_PER_WAKEUP):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                on_frames(self, frames)
            except Exception:  # a bug here must not strand the frames behind it
                logger.exception("failed to handle a message from worker %s", self.address)
        # Frames are left and the FD will not signal them again: continue next turn.
        self._drain_scheduled = True
        self._loop.call_soon(self._drain)
