"""The render tier's connection to its gpu-workers: handshake, routing, streams, liveness.

One DEALER per worker, all driven from the asyncio loop without a task per message: the
socket's file descriptor is watched with `loop.add_reader`, and the callback drains every
queued frame, decodes it and fans each request's delta out to its `RequestStream` (a
deque plus a future to wake the one consumer). A single monitor task sends
`ClientHeartbeat`s, re-sends `Hello` to workers that have not (or no longer) answered, and
marks a worker dead when its messages stop for `heartbeat_timeout_s`.

Routing policy lives in `render_server.routing`; this module only gathers its inputs.
The set of workers may change while serving (`set_addresses`, fed by
`render_server.discovery`): a removed worker is drained, not cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import zmq
from zmq.utils.monitor import recv_monitor_message

from render_server.routing import (
    PrefixAffinity,
    RoutingMode,
    WorkerLoad,
    affinity_hashes,
    choose_worker,
    continuation,
    round_robin,
)
from shared.model_card import ModelCard
from shared.protocol import (
    MAX_BATCH,
    Abort,
    ClientHeartbeat,
    Deltas,
    Encoder,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    ProtocolError,
    Rejected,
    RequestDelta,
    Welcome,
    WorkerMessageDecoder,
    WorkerStats,
)
from shared.transport import CurveKeys, make_dealer

logger = logging.getLogger(__name__)

WorkerErrorCode = Literal["rejected", "worker_lost", "no_workers", "timeout"]

# Frames handled per wake-up of one socket before yielding to the loop, so a flood from
# one worker cannot starve HTTP writes.
_MAX_FRAMES_PER_WAKEUP = 256
# How long closing waits for queued Aborts to reach the workers.
_CLOSE_LINGER_MS = 500


class WorkerError(Exception):
    """A request or the pool could not be served by a worker.

    `code` is "rejected" (the worker refused the request; `reject_code` says why),
    "worker_lost" (its worker stopped answering), "no_workers" (none is usable) or
    "timeout".
    """

    def __init__(
        self, code: WorkerErrorCode, message: str, *, reject_code: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reject_code = reject_code


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


def _merge(into: RequestDelta, new: RequestDelta) -> None:
    """Fold a later delta of the same request into one the consumer has not taken yet."""
    into.new_token_ids.extend(new.new_token_ids)
    if new.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = new.logprobs
        else:
            into.logprobs.extend(new.logprobs)
    if new.finish_reason is not None:
        into.finish_reason = new.finish_reason
        into.stop_token_id = new.stop_token_id
    if new.num_prompt_tokens:
        into.num_prompt_tokens = new.num_prompt_tokens
    if new.num_cached_tokens:
        into.num_cached_tokens = new.num_cached_tokens
    if new.error is not None:
        into.error = new.error
    if into.queue_time is None:
        into.queue_time = new.queue_time  # only a request's first delta carries it


class RequestStream:
    """The deltas of one request, in order, for a single consumer.

    Iterate it (`async for delta in stream`); deltas that queued up while the consumer
    was busy come merged into one. Iteration ends after the delta carrying
    `finish_reason` and raises `WorkerError` if the worker rejected the request or was
    lost. Leaving the iteration early, being cancelled, `abort()` or leaving
    `async with stream:` sends Abort if the request is still running.

    `request` and `output_token_ids` (everything received so far, consumed or not) are
    what a resend elsewhere needs: see `render_server.routing.continuation`.
    """

    def __init__(self, request: Generate, link: _WorkerLink) -> None:
        self.request_id = request.request_id
        self.worker_address = link.address
        self.request = request
        self.output_token_ids: list[int] = []
        self.num_queue_full = 0
        """Workers that refused it with a full queue (each is tried at most once)."""
        self.finish_reason: FinishReason | None = None
        self._link = link
        self._pending: deque[RequestDelta] = deque()
        self._error: WorkerError | None = None
        self._ended = False  # nothing more will be pushed: finished, failed or aborted
        self._waiter: asyncio.Future[None] | None = None

    @property
    def is_finished(self) -> bool:
        """The worker is done with it (finished, rejected, lost or aborted)."""
        return self._ended

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        try:
            while True:
                if self._pending:
                    delta = self._take()
                    yield delta
                    if delta.finish_reason is not None:
                        return
                elif self._error is not None:
                    raise self._error
                elif self._ended:
                    return
                else:
                    self._waiter = asyncio.get_running_loop().create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
        finally:
            # A cancelled consumer lands here at once; an early `break` or an exception in
            # the consumer's loop body when the abandoned generator is closed or collected.
            self._cancel()

    async def abort(self) -> None:
        """Stop the request on the worker; iteration then ends with finish_reason "abort"."""
        self._cancel()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._cancel()

    # ---- called by the pool -----------------------------------------------------------

    def _push(self, delta: RequestDelta) -> None:
        self._pending.append(delta)
        self.output_token_ids.extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self._ended = True
        self._wake()

    def _fail(self, error: WorkerError) -> None:
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._wake()

    def _cancel(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.finish_reason = "abort"
        self._link.abort(self.request_id)
        self._pending.append(
            RequestDelta(request_id=self.request_id, new_token_ids=[], finish_reason="abort")
        )
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self) -> RequestDelta:
        pending = self._pending
        delta = pending.popleft()
        while pending:
            _merge(delta, pending.popleft())
        return delta


class _WorkerLink:
    """One DEALER to one worker, and what the pool has learned about that worker."""

    def __init__(
        self, pool: WorkerPool, address: str, socket: zmq.Socket, loop: asyncio.AbstractEventLoop
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
        self.streams: dict[str, RequestStream] = {}
        self.closed = False
        self.draining = False  # no longer in the pool's addresses: finish, take nothing new
        self._pool = pool
        self._loop = loop
        # Frames the full pipe refused, in order; retried every heartbeat round (the pipe
        # only fills when the worker stops reading, i.e. it is about to be marked dead).
        self._backlog: deque[bytes] = deque()
        self._aborts: list[str] = []
        self._drain_scheduled = False
        self._fd = socket.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._drain)
        # A dropped connection (the worker process died) is known at once from the socket's
        # monitor; heartbeats still catch a worker that hangs with its socket open.
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_fd = self._monitor.getsockopt(zmq.FD)
        loop.add_reader(self._monitor_fd, self._on_monitor)

    @property
    def is_routable(self) -> bool:
        """New requests (and failed-over ones) may go here."""
        return self.welcomed and self.alive and not self.draining

    def load(self) -> WorkerLoad:
        stats = self.stats
        if stats is None:
            return WorkerLoad(self.address, len(self.streams))
        return WorkerLoad(self.address, len(self.streams), stats.num_running, stats.num_waiting)

    def send(self, message: object) -> None:
        self.send_frame(self._pool._encoder.encode(message))

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
            self._pool._lose(self, reason="its connection closed")

    def _poke(self) -> None:
        # ZMQ's FD only signals "look at EVENTS", and any send may consume that signal
        # for a frame that arrived meanwhile; check ourselves so it is never stranded.
        if (
            not self._drain_scheduled
            and not self.closed
            and self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
        ):
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self.closed:
            return
        socket = self.socket
        on_frames = self._pool._on_frames
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


class WorkerPool:
    """This render process's connections to every gpu-worker it was given.

    `start()` connects and says Hello; workers whose ModelCard names another tokenizer
    (or another model id, when `model_id` is set) are refused and never routed to.
    `submit()` picks a live worker (by `routing`: least load with prefix affinity, or
    round robin) and returns the request's `RequestStream`. `set_addresses()` changes the
    set of workers while serving. Everything runs on the event loop that called `start()`.
    """

    def __init__(
        self,
        addresses: list[str],
        *,
        tokenizer_digest: str,
        model_id: str | None = None,
        client_id: str = "render",
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 3.0,
        curve: CurveKeys | None = None,
        routing: RoutingMode = "prefix",
    ) -> None:
        # `addresses` may be empty when discovery supplies them later (set_addresses).
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        self.addresses = list(dict.fromkeys(addresses))
        """The workers this pool routes to (draining ones excluded), in the order given."""
        self.routing: RoutingMode = routing
        self.tokenizer_digest = tokenizer_digest
        self.model_id = model_id
        self.client_id = client_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.bad_frames = 0
        """Frames from workers that did not decode (dropped)."""
        self.unknown_deltas = 0
        """Deltas for requests no longer tracked (aborted or lost), dropped."""
        self.failovers = 0
        """Requests resumed on another worker after theirs was lost."""
        self._curve = curve
        self._identity = uuid.uuid4().bytes
        self._encoder = Encoder()
        self._decoder = WorkerMessageDecoder()
        self._hello = self._encoder.encode(Hello(client_id=client_id))
        self._links: list[_WorkerLink] = []
        self._affinity = PrefixAffinity()
        self._rotation = 0
        self._model_card: ModelCard | None = None
        self._any_welcome = asyncio.Event()
        self._context: zmq.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: asyncio.Task[None] | None = None

    @property
    def model_card(self) -> ModelCard | None:
        """The card of the first worker that was accepted."""
        return self._model_card

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Connect to every worker and wait until one has welcomed us.

        Raises WorkerError("no_workers") after `ready_timeout_s`; the pool keeps trying
        in the background until `close()`.
        """
        if self._context is not None:
            raise RuntimeError("the worker pool is already started")
        self._loop = loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        for address in self.addresses:
            self._connect(address)
        self._monitor = loop.create_task(self._monitor_loop(), name="duet-worker-monitor")
        try:
            await asyncio.wait_for(self._any_welcome.wait(), ready_timeout_s)
        except TimeoutError:
            refused = [link.address for link in self._links if link.refused]
            detail = f" (refused: {', '.join(refused)})" if refused else ""
            raise WorkerError(
                "no_workers", f"no worker accepted within {ready_timeout_s:g}s{detail}"
            ) from None

    def set_addresses(self, addresses: list[str]) -> None:
        """Make `addresses` the pool's workers, without a restart.

        New addresses are connected and greeted; a worker no longer listed is drained: it
        gets no new requests, its in-flight streams run to their end, then its connection
        is closed. Listing a draining worker again takes it back into service.
        """
        wanted = list(dict.fromkeys(addresses))
        added = [address for address in wanted if address not in self.addresses]
        removed = [address for address in self.addresses if address not in wanted]
        self.addresses = wanted
        if self._monitor is None:
            return  # not running: start() connects to whatever is listed (close() ended it)
        for link in self._links:
            if link.address in removed:
                link.draining = True
                logger.info(
                    "worker %s removed: draining %d in-flight requests",
                    link.address,
                    len(link.streams),
                )
        for address in added:
            link = next((link for link in self._links if link.address == address), None)
            if link is not None:
                link.draining = False
                logger.info("worker %s is listed again: back in service", address)
            else:
                logger.info("worker %s added", address)
                self._connect(address)
        self._retire_drained()

    async def close(self) -> None:
        """Abort what is in flight, fail its streams, close every socket."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for link in self._links:
            streams = list(link.streams.values())
            for stream in streams:
                link.abort(stream.request_id)
                stream._fail(WorkerError("worker_lost", "the worker pool was closed"))
            link.close()
        self._links.clear()
        if self._context is not None:
            # term() waits (up to the linger) for the Aborts to leave; not on the loop.
            await asyncio.to_thread(self._context.term)

    def statuses(self) -> list[WorkerStatus]:
        """One entry per connected worker, draining ones included, in order of connection."""
        return [
            WorkerStatus(
                address=link.address,
                worker_id=link.worker_id,
                model_card=link.model_card,
                connected=link.welcomed,
                alive=link.alive,
                last_heartbeat=link.last_heartbeat,
                stats=link.stats,
                outstanding=len(link.streams),
                refused=link.refused,
                draining=link.draining,
            )
            for link in self._links
        ]

    def is_ready(self) -> bool:
        """At least one accepted worker is alive (and not draining)."""
        return any(link.is_routable for link in self._links)

    async def submit(self, request: Generate) -> RequestStream:
        """Choose a worker for `request`, send it, and return its stream.

        Raises WorkerError("no_workers") when no accepted worker is alive, and ValueError
        when a request with the same id is still in flight in this pool.
        """
        links = [link for link in self._links if link.is_routable]
        if not links:
            raise WorkerError("no_workers", "no live worker to send the request to")
        request_id = request.request_id
        if any(request_id in link.streams for link in self._links):
            raise ValueError(f"request {request_id!r} is already in flight")
        card = self._model_card
        if self.routing == "round_robin":
            hashes = []  # blind to prefixes: no hashing cost, no affinity map
            index = round_robin(len(links), self._rotation)
        else:
            hashes = affinity_hashes(request, card.block_size) if card is not None else []
            preferred, _ = self._affinity.longest_match(hashes)
            index = choose_worker(
                [link.load() for link in links], preferred=preferred, rotation=self._rotation
            )
        self._rotation += 1
        link = links[index]
        if hashes:
            self._affinity.record(hashes, link.address)
        stream = RequestStream(request, link)
        link.streams[request_id] = stream
        link.send(request)
        return stream

    # ---- incoming ---------------------------------------------------------------------

    def _on_frames(self, link: _WorkerLink, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.bad_frames += 1
            logger.warning("dropped a %d-part message from worker %s", len(frames), link.address)
            return
        try:
            message = self._decoder.decode(frames[0])
        except ProtocolError as exc:
            self.bad_frames += 1
            logger.warning("dropped a bad frame from worker %s: %s", link.address, exc)
            return
        link.last_seen = time.monotonic()
        kind = type(message)
        if kind is Deltas:
            streams = link.streams
            for delta in message.deltas:
                stream = streams.get(delta.request_id)
                if stream is None:
                    self.unknown_deltas += 1
                    continue
                if delta.finish_reason is not None:
                    del streams[delta.request_id]
                stream._push(delta)
        elif kind is Heartbeat:
            link.stats = message.stats
            link.last_heartbeat = time.time()
        elif kind is Rejected:
            stream = link.streams.pop(message.request_id, None)
            if stream is not None and message.code == "queue_full":
                stream.num_queue_full += 1
            if stream is not None and not (
                # A full queue is this worker's state, not the request's fault: try another.
                message.code == "queue_full"
                and not stream.output_token_ids
                and stream.num_queue_full < len(self._links)
                and self._move(stream, exclude=link)
            ):
                error = f"worker {link.address} rejected the request: {message.message}"
                stream._fail(WorkerError("rejected", error, reject_code=message.code))
            if message.code == "protocol":
                self._say_hello(link)  # it restarted and forgot us: introduce again
        elif kind is Welcome:
            self._on_welcome(link, message)
        if link.welcomed and not link.alive:
            link.alive = True
            logger.warning("worker %s is back", link.address)

    def _on_welcome(self, link: _WorkerLink, welcome: Welcome) -> None:
        card = welcome.model_card
        problem = None
        if card.tokenizer_digest != self.tokenizer_digest:
            problem = (
                f"its tokenizer digest {card.tokenizer_digest[:16]}... differs from ours "
                f"{self.tokenizer_digest[:16]}..."
            )
        elif self.model_id is not None and card.model_id != self.model_id:
            problem = f"it serves {card.model_id!r}, not {self.model_id!r}"
        if problem is not None:
            if not link.refused:
                logger.error("refusing worker %s: %s", link.address, problem)
            link.refused = True
            link.welcomed = link.alive = False
            self._fail_all(link, "worker_lost", f"worker {link.address} was refused: {problem}")
            return
        if not link.welcomed:
            logger.info("worker %s (%s) serves %s", link.address, welcome.worker_id, card.model_id)
        link.refused = False
        link.worker_id = welcome.worker_id
        link.model_card = card
        link.welcomed = link.alive = True
        if self._model_card is None:
            self._model_card = card
        self._any_welcome.set()

    # ---- liveness ---------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        # Liveness is checked a few times per timeout, so a dead worker is noticed at most
        # an eighth of the timeout late; heartbeats go out at their own interval.
        period = min(self.heartbeat_interval_s, self.heartbeat_timeout_s / 8)
        next_beat = time.monotonic() + self.heartbeat_interval_s  # start() sent Hello
        while True:
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval_s
                    self._send_heartbeats()
                for link in self._links:
                    if link.alive and now - link.last_seen > self.heartbeat_timeout_s:
                        self._lose(link)
                self._retire_drained()
            except Exception:  # the monitor must outlive any bug in one round
                logger.exception("worker monitor round failed")
            await asyncio.sleep(period)

    def _send_heartbeats(self) -> None:
        beat = self._encoder.encode(ClientHeartbeat(sent_at=time.time()))
        now = time.monotonic()
        for link in self._links:
            if link.refused:
                continue
            link.flush_backlog()
            if link.alive:
                link.send_frame(beat)
            elif now - link.hello_sent_at >= self.heartbeat_timeout_s:
                # Not (or no longer) answering: it may have restarted and forgotten us.
                # Not every beat, since ZMQ queues them all for a worker that is down.
                self._say_hello(link)

    def _connect(self, address: str) -> _WorkerLink:
        assert self._context is not None and self._loop is not None
        socket = make_dealer(self._context, address, identity=self._identity, curve=self._curve)
        link = _WorkerLink(self, address, socket, self._loop)
        self._links.append(link)
        self._say_hello(link)
        return link

    def _retire_drained(self) -> None:
        """Close the draining links whose last stream has ended (checked every monitor
        round, so a link closes at most one round after its last request finished)."""
        for link in [link for link in self._links if link.draining and not link.streams]:
            logger.info("worker %s drained: disconnected", link.address)
            link.close()
            self._links.remove(link)

    def _say_hello(self, link: _WorkerLink) -> None:
        link.hello_sent_at = time.monotonic()
        link.send_frame(self._hello)

    def _lose(self, link: _WorkerLink, reason: str | None = None) -> None:
        link.alive = False
        silent = time.monotonic() - link.last_seen
        streams = list(link.streams.values())
        moved = 0
        for stream in streams:
            # Aborted there now, so a worker that resumes frees its KV blocks at once.
            link.abort(stream.request_id)
            if self._move(stream, exclude=link):
                moved += 1
            else:
                stream._fail(
                    WorkerError("worker_lost", f"worker {link.address} stopped responding")
                )
        logger.warning(
            "worker %s %s: marked dead; %d of %d requests moved to other workers",
            link.address,
            reason or f"silent for {silent:.1f}s",
            moved,
            len(streams),
        )

    def _move(self, stream: RequestStream, exclude: _WorkerLink) -> bool:
        """Resume a stream on another live worker: the tokens it already streamed join
        the prompt, so the client's stream goes on with nothing lost or repeated."""
        links = [link for link in self._links if link is not exclude and link.is_routable]
        if not links:
            return False
        target = links[choose_worker([candidate.load() for candidate in links])]
        stream._link = target
        stream.worker_address = target.address
        target.streams[stream.request_id] = stream
        target.send(continuation(stream.request, stream.output_token_ids))
        self.failovers += 1
        return True

    def _fail_all(self, link: _WorkerLink, code: WorkerErrorCode, message: str) -> None:
        for stream in list(link.streams.values()):
            # Aborted now so a worker that resumes frees their KV blocks at once.
            link.abort(stream.request_id)
            stream._fail(WorkerError(code, message))
