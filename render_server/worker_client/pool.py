"""The render tier's connection to its gpu-workers: handshake, routing, streams, liveness.

One DEALER per worker, all driven from the asyncio loop without a task per message: the
socket's file descriptor is watched with `loop.add_reader`, and the callback drains every
queued frame, decodes it and fans each request's delta out to its `RequestStream` (a
deque plus a future to wake the one consumer). A single monitor task sends
`ClientHeartbeat`s, re-sends `Hello` to workers that have not (or no longer) answered, and
marks a worker dead when its messages stop for `heartbeat_timeout_s` (but not for the
time this process itself was paused, e.g. SIGSTOP: the silence was ours).

A worker that forgot this render server (it restarted, or reaped us while we were paused)
answers a request with `Rejected("protocol")`: the pool greets it again and resends the
request where it stopped, so a paused render server resumes its streams.

LoRA adapters: the pool's `LoRAOperations` (render_server.worker_client.lora) keeps the
adapters every worker should hold and runs `load_lora` / `unload_lora` on every worker; the
pool feeds it welcomes, heartbeats, results and losses. A request for an adapter only goes
to workers that register it.

Routing policy lives in `render_server.worker_client.routing`; this module only gathers its inputs.
Streams are in `render_server.worker_client.request_stream`, sockets in
`render_server.worker_client.link`.
The set of workers may change while serving (`set_addresses`, fed by
`render_server.worker_client.discovery`): a removed worker is drained, not cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence

import zmq

from render_server.worker_client.link import WorkerLink, WorkerStatus
from render_server.worker_client.lora import LoRAModule, LoRAOperations, LoRAOutcome
from render_server.worker_client.request_stream import RequestStream, WorkerError
from render_server.worker_client.routing import (
    PrefixAffinity,
    RoutingMode,
    WorkerLoad,
    adapter_holders,
    affinity_hashes,
    choose_worker,
    continuation,
    round_robin,
)
from shared.model_card import ModelCard
from shared.protocol import (
    ClientHeartbeat,
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    LoRAResult,
    ProtocolError,
    Rejected,
    Welcome,
    WorkerMessageDecoder,
)
from shared.transport import CurveKeys, make_dealer

logger = logging.getLogger(__name__)

# Resends of one request to workers that forgot this render server: enough for a pause
# and a worker restart, without looping against a worker that keeps dropping us.
_MAX_RESENDS = 3

__all__ = ["RequestStream", "WorkerError", "WorkerPool", "WorkerStatus"]


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
        lora_modules: Sequence[LoRAModule] = (),
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
        self.resends = 0
        """Requests resent to a worker that had forgotten this render server."""
        self._curve = curve
        self._identity = uuid.uuid4().bytes
        self._encoder = Encoder()
        self._decoder = WorkerMessageDecoder()
        self._hello = self._encoder.encode(Hello(client_id=client_id))
        self._links: list[WorkerLink] = []
        self._affinity = PrefixAffinity()
        self._rotation = 0
        self._model_card: ModelCard | None = None
        self._any_welcome = asyncio.Event()
        self._context: zmq.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.lora = LoRAOperations(lora_modules)
        """The adapters every worker should hold and the operations in flight."""

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
                link.start_draining()
                logger.info(
                    "worker %s removed: draining %d in-flight requests",
                    link.address,
                    len(link.streams),
                )
        for address in added:
            listed = next((link for link in self._links if link.address == address), None)
            if listed is not None:
                listed.stop_draining()
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
            link.fail_streams("worker_lost", "the worker pool was closed")
            link.close()
        self._links.clear()
        if self._context is not None:
            # term() waits (up to the linger) for the Aborts to leave; not on the loop.
            await asyncio.to_thread(self._context.term)

    def statuses(self) -> list[WorkerStatus]:
        """One entry per connected worker, draining ones included, in order of connection."""
        return [link.status() for link in self._links]

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
        links, loads = self._servers_of(request, links)
        if self.routing == "round_robin":
            hashes = []  # blind to prefixes: no hashing cost, no affinity map
            index = round_robin(len(links), self._rotation)
        else:
            hashes = affinity_hashes(request, card.block_size) if card is not None else []
            preferred, _ = self._affinity.longest_match(hashes)
            index = choose_worker(loads, preferred=preferred, rotation=self._rotation)
        self._rotation += 1
        link = links[index]
        if hashes:
            self._affinity.record(hashes, link.address)
        stream = RequestStream(request, link)
        link.track(stream)
        link.send(request)
        return stream

    def _servers_of(
        self, request: Generate, links: list[WorkerLink]
    ) -> tuple[list[WorkerLink], list[WorkerLoad]]:
        """The links among `links` that `request` may go to, with their loads: for an
        adapter, the workers that register it (resident ones first, unless round robin)."""
        loads = [link.load(request.lora_name) for link in links]
        if request.lora_name is None:
            return links, loads
        keep = adapter_holders(loads, resident_first=self.routing != "round_robin")
        return [links[i] for i in keep], [loads[i] for i in keep]

    # ---- LoRA adapters ------------------------------------------------------------------

    def lora_adapters(self) -> dict[str, str | None]:
        """Every adapter a request may name, with its path where this pool knows it."""
        return self.lora.adapters(self._links)

    async def load_lora(self, name: str, path: str, timeout_s: float) -> list[LoRAOutcome]:
        """Load adapter `name` from `path` (on the workers' disks) on every live worker,
        all or nothing (`LoRAOperations.load`)."""
        return await self.lora.load(self._routable_links(), name, path, timeout_s)

    async def unload_lora(self, name: str, timeout_s: float) -> list[LoRAOutcome]:
        """Unload adapter `name` from every live worker (`LoRAOperations.unload`)."""
        return await self.lora.unload(self._routable_links(), name, timeout_s)

    def _routable_links(self) -> list[WorkerLink]:
        return [link for link in self._links if link.is_routable]

    # ---- incoming ---------------------------------------------------------------------

    def _on_frames(self, link: WorkerLink, frames: list[bytes]) -> None:
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
        link.heard_from()
        if isinstance(message, Deltas):
            self._on_deltas(link, message)
        elif isinstance(message, Heartbeat):
            link.take_heartbeat(message.stats)
        elif isinstance(message, Rejected):
            self._on_rejected(link, message)
        elif isinstance(message, Welcome):
            self._on_welcome(link, message)
        elif isinstance(message, LoRAResult):
            self.lora.on_result(link, message)
        if link.revive():
            logger.warning("worker %s is back", link.address)

    def _on_deltas(self, link: WorkerLink, message: Deltas) -> None:
        streams = link.streams
        for delta in message.deltas:
            stream = streams.get(delta.request_id)
            if not delta.new_token_ids and delta.finish_reason is None and not delta.error:
                if stream is not None:  # the worker's acknowledgement: it took the request
                    stream.acknowledge()
                continue
            if stream is None:
                self.unknown_deltas += 1
                continue
            if delta.finish_reason is not None:
                link.untrack(delta.request_id)
            stream.push(delta)

    def _on_rejected(self, link: WorkerLink, rejected: Rejected) -> None:
        stream = link.untrack(rejected.request_id)
        if rejected.code == "protocol":
            # It does not know us (restarted, or reaped us while we were paused):
            # introduce again, then resend on the same socket, which keeps them in order.
            self._say_hello(link)
            if stream is not None and stream.num_resends < _MAX_RESENDS:
                stream.num_resends += 1
                self.resends += 1
                link.track(stream)
                link.send(continuation(stream.request, stream.output_token_ids))
                return
        if stream is not None and rejected.code == "queue_full":
            stream.num_queue_full += 1
        if stream is not None and not (
            # A full queue is this worker's state, not the request's fault: try another.
            rejected.code == "queue_full"
            and not stream.output_token_ids
            and stream.num_queue_full < len(self._links)
            and self._move(stream, exclude=link)
        ):
            error = f"worker {link.address} rejected the request: {rejected.message}"
            stream.fail(WorkerError("rejected", error, reject_code=rejected.code))

    def _on_welcome(self, link: WorkerLink, welcome: Welcome) -> None:
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
            link.refuse()
            link.fail_streams("worker_lost", f"worker {link.address} was refused: {problem}")
            return
        if not link.welcomed:
            logger.info("worker %s (%s) serves %s", link.address, welcome.worker_id, card.model_id)
        link.accept(welcome.worker_id, card)
        # A first heartbeat at once: from it on the worker frees our requests if we fall
        # silent (it cannot tell a client that never heartbeats from one that is gone).
        link.send(ClientHeartbeat(sent_at=time.time()))
        if self._model_card is None:
            self._model_card = card
        self.lora.on_welcome(link, card)
        self._any_welcome.set()

    # ---- liveness ---------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        # Liveness is checked a few times per timeout, so a dead worker is noticed at most
        # an eighth of the timeout late; heartbeats go out at their own interval.
        period = min(self.heartbeat_interval_s, self.heartbeat_timeout_s / 8)
        next_beat = time.monotonic() + self.heartbeat_interval_s  # start() sent Hello
        last_round = time.monotonic()
        while True:
            try:
                now = time.monotonic()
                if now - last_round > period + self.heartbeat_timeout_s / 2:
                    self._after_pause(now - last_round)
                last_round = now
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval_s
                    self._send_heartbeats()
                for link in self._links:
                    if link.alive and link.seconds_silent(now) > self.heartbeat_timeout_s:
                        self._lose(link)
                self._retire_drained()
            except Exception:  # the monitor must outlive any bug in one round
                logger.exception("worker monitor round failed")
            await asyncio.sleep(period)

    def _after_pause(self, paused_s: float) -> None:
        """This process did not run for `paused_s` (SIGSTOP, a VM pause, a loop stall): its
        workers' silence over that time says nothing about them. Each gets a fresh full
        timeout, starting with what arrived meanwhile."""
        logger.warning("this render process was paused for %.1fs", paused_s)
        now = time.monotonic()
        for link in self._links:
            link.forgive_silence(now)

    def _send_heartbeats(self) -> None:
        beat = self._encoder.encode(ClientHeartbeat(sent_at=time.time()))
        now = time.monotonic()
        for link in self._links:
            if link.refused:
                continue
            link.flush_backlog()
            if link.alive:
                link.send_frame(beat)
            elif link.seconds_since_hello(now) >= self.heartbeat_timeout_s:
                # Not (or no longer) answering: it may have restarted and forgotten us.
                # Not every beat, since ZMQ queues them all for a worker that is down.
                self._say_hello(link)

    def _connect(self, address: str) -> WorkerLink:
        assert self._context is not None and self._loop is not None
        socket = make_dealer(self._context, address, identity=self._identity, curve=self._curve)
        link = WorkerLink(
            address,
            socket,
            self._loop,
            encode=self._encoder.encode,
            on_frames=self._on_frames,
            on_disconnect=lambda lost: self._lose(lost, reason="its connection closed"),
        )
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

    def _say_hello(self, link: WorkerLink) -> None:
        link.say_hello(self._hello)

    def _lose(self, link: WorkerLink, reason: str | None = None) -> None:
        link.mark_lost()
        self.lora.on_lost(link, f"worker {link.address} stopped responding")
        silent = link.seconds_silent(time.monotonic())
        streams = list(link.streams.values())
        moved = 0
        for stream in streams:
            # Aborted there now, so a worker that resumes frees its KV blocks at once.
            link.abort(stream.request_id)
            if self._move(stream, exclude=link):
                moved += 1
            else:
                stream.fail(WorkerError("worker_lost", f"worker {link.address} stopped responding"))
        logger.warning(
            "worker %s %s: marked dead; %d of %d requests moved to other workers",
            link.address,
            reason or f"silent for {silent:.1f}s",
            moved,
            len(streams),
        )

    def _move(self, stream: RequestStream, exclude: WorkerLink) -> bool:
        """Resume a stream on another live worker: the tokens it already streamed join
        the prompt, so the client's stream goes on with nothing lost or repeated."""
        links = [link for link in self._links if link is not exclude and link.is_routable]
        if not links:
            return False
        links, loads = self._servers_of(stream.request, links)
        target = links[choose_worker(loads)]
        stream.move_to(target)
        target.track(stream)
        target.send(continuation(stream.request, stream.output_token_ids))
        self.failovers += 1
        return True
