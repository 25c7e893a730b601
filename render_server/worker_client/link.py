"""One DEALER socket to one gpu-worker, driven from the asyncio loop.

The socket's file descriptor is watched with `loop.add_reader`; `_drain` reads every queued
frame and hands it to the pool's callback. Sends never block: a full pipe keeps frames in
order in a backlog. The socket monitor reports a dropped connection at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from render_server.worker_client.request_stream import RequestStream
from render_server.worker_client.routing import AdapterPresence, WorkerLoad
from shared.model_card import ModelCard
from shared.protocol import MAX_BATCH, Abort, RenderToWorker, WorkerStats

logger = logging.getLogger(__name__)

# Frames handled per wake-up of one socket before yielding to the loop, so a flood from
# one worker cannot starve HTTP writes.
_MAX_FRAMES_PER_WAKEUP = 256
# How long closing waits for queued Aborts to reach the workers.
_CLOSE_LINGER_MS = 500


class WorkerLink:
    """One DEALER to one worker, and what the pool has learned about that worker."""

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
        self.worker_id: str | None = None
        self.model_card: ModelCard | None = None
        self.welcomed = False
        self.refused = False
        self.alive = False
        self.last_seen = 0.0  # monotonic time of its last frame of any kind
        self.last_heartbeat = 0.0
        self.hello_sent_at = 0.0  # monotonic
        self.stats: WorkerStats | None = None
        self.lora_changes: dict[str, bool] = {}
        """Adapters this worker loaded (True) or unloaded (False) by our request that its
        heartbeats do not show yet: one sent before the change must not undo it."""
        self.streams: dict[str, RequestStream] = {}
        self.closed = False
        self.draining = False  # no longer in the pool's addresses: finish, take nothing new
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

    @property
    def is_routable(self) -> bool:
        """New requests (and failed-over ones) may go here."""
        return self.welcomed and self.alive and not self.draining

    def load(self, lora_name: str | None = None) -> WorkerLoad:
        """This worker as the router sees it for a request of `lora_name` (None: base)."""
        stats = self.stats
        if stats is None:
            return WorkerLoad(self.address, len(self.streams))
        adapter: AdapterPresence = "absent"
        if lora_name is not None:
            if lora_name in stats.lora_resident:
                adapter = "resident"
            elif lora_name in stats.lora_registered:
                adapter = "registered"
        return WorkerLoad(
            self.address, len(self.streams), stats.num_running, stats.num_waiting, adapter
        )

    def in_flight_adapters(self) -> set[str]:
        """The adapters of this render process's requests on the worker."""
        return {
            stream.request.lora_name
            for stream in self.streams.values()
            if stream.request.lora_name is not None
        }

    def send(self, message: RenderToWorker) -> None:
        self.send_frame(self._encode(message))

    def send_frame(self, frame: bytes) -> None:
        if self.closed:
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
        while self._backlog and not self.closed:
            try:
                self.socket.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()
        self._poke()

    def abort(self, request_id: str) -> None:
        """Forget the request and queue an Abort; all aborts of one loop turn go together."""
        self.streams.pop(request_id, None)
        if self.closed:
            return
        self._aborts.append(request_id)
        if len(self._aborts) == 1:
            self._loop.call_soon(self.flush_aborts)

    def flush_aborts(self) -> None:
        while self._aborts:
            batch, self._aborts = self._aborts[:MAX_BATCH], self._aborts[MAX_BATCH:]
            self.send(Abort(request_ids=batch))

    def close(self) -> None:
        if self.closed:
            return
        self.flush_aborts()
        self.closed = True
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
        if disconnected and self.alive and not self.closed:
            self._on_disconnect(self)

    def _poke(self) -> None:
        # ZMQ's FD only signals "look at EVENTS", and any send may consume that signal
        # for a frame that arrived meanwhile; check ourselves so it is never stranded.
        if (
            not self._drain_scheduled
            and not self.closed
            and cast(int, self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        ):
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.closed:
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
