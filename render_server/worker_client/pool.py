"""The render tier's connection to its gpu-workers: handshake, routing, streams, liveness.

One DEALER per worker (`render_server.worker_client.link`), all driven from the asyncio
loop without a task per message: the socket's file descriptor is watched with
`loop.add_reader`, and the callback drains every queued frame, decodes it and fans each
request's delta out to its `RequestStream` (a deque plus a future to wake the one consumer).
A single monitor task (`render_server.worker_client.liveness`) sends `ClientHeartbeat`s,
re-sends `Hello` to workers that have not (or no longer) answered, and marks a worker dead
when its messages stop for `heartbeat_timeout_s`.

A dead worker's requests, and those a worker rejected because it forgot this render server
or its queue is full, go on elsewhere (`render_server.worker_client.failover`), so a paused
render server resumes its streams.

LoRA adapters: the pool's `LoRAOperations` (render_server.worker_client.lora) keeps the
adapters every worker should hold and runs `load_lora` / `unload_lora` on every worker; the
pool feeds it welcomes, results and losses. A request for an adapter only goes to workers
that register it.

Routing policy lives in `render_server.worker_client.routing`; this module only gathers its
inputs. Streams are in `render_server.worker_client.request_stream`.
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

from render_server.worker_client.failover import Failover
from render_server.worker_client.link import WorkerLink, WorkerStatus
from render_server.worker_client.liveness import LivenessMonitor
from render_server.worker_client.lora import LoRAModule, LoRAOperations, LoRAOutcome
from render_server.worker_client.request_stream import RequestStream, WorkerError
from render_server.worker_client.routing import Router, RoutingMode
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
        self.tokenizer_digest = tokenizer_digest
        self.model_id = model_id
        self.client_id = client_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.bad_frames = 0
        """Frames from workers that did not decode (dropped)."""
        self.unknown_deltas = 0
        """Deltas for requests no longer tracked (aborted or lost), dropped."""
        self._curve = curve
        self._identity = uuid.uuid4().bytes
        self._encoder = Encoder()
        self._decoder = WorkerMessageDecoder()
        self._hello = self._encoder.encode(Hello(client_id=client_id))
        self._links: list[WorkerLink] = []
        self._router = Router(routing)
        self._failover = Failover(lambda: self._links, self._router, hello=self._hello)
        self._liveness = LivenessMonitor(
            lambda: self._links,
            interval_s=heartbeat_interval_s,
            timeout_s=heartbeat_timeout_s,
            encode=self._encoder.encode,
            hello=self._hello,
            on_silent=self._lose,
            after_round=self._retire_drained,
        )
        self._model_card: ModelCard | None = None
        self._any_welcome = asyncio.Event()
        self._context: zmq.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.lora = LoRAOperations(lora_modules)
        """The adapters every worker should hold and the operations in flight."""

    @property
    def routing(self) -> RoutingMode:
        """How `submit` chooses a worker (`routing.RoutingMode`)."""
        return self._router.mode

    @property
    def failovers(self) -> int:
        """Requests resumed on another worker after theirs was lost."""
        return self._failover.failovers

    @property
    def resends(self) -> int:
        """Requests resent to a worker that had forgotten this render server."""
        return self._failover.resends

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
        self._monitor = loop.create_task(self._liveness.run(), name="duet-worker-monitor")
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
        loads = [link.load(request.lora_name) for link in links]
        link = links[self._router.choose(request, loads, card.block_size if card else None)]
        stream = RequestStream(request, link)
        link.track(stream)
        link.send(request)
        return stream

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
            self._failover.on_rejected(link, message)
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

    # ---- membership and losses -----------------------------------------------------------

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
        link.say_hello(self._hello)
        return link

    def _retire_drained(self) -> None:
        """Close the draining links whose last stream has ended (checked every monitor
        round, so a link closes at most one round after its last request finished)."""
        for link in [link for link in self._links if link.draining and not link.streams]:
            logger.info("worker %s drained: disconnected", link.address)
            link.close()
            self._links.remove(link)

    def _lose(self, link: WorkerLink, reason: str | None = None) -> None:
        """The worker stopped answering (silent past the timeout, or its connection closed):
        its LoRA operations fail, its requests move to other workers."""
        link.mark_lost()
        self.lora.on_lost(link, f"worker {link.address} stopped responding")
        silent = link.seconds_silent(time.monotonic())
        in_flight = len(link.streams)
        moved = self._failover.evacuate(link)
        logger.warning(
            "worker %s %s: marked dead; %d of %d requests moved to other workers",
            link.address,
            reason or f"silent for {silent:.1f}s",
            moved,
            in_flight,
        )
