"""Where a request goes when its worker cannot finish it.

A lost worker's requests resume on another live worker: the tokens they already streamed
join the prompt (`routing.continuation`), so a client's stream goes on with nothing lost or
repeated. A worker that forgot this render server (it restarted, or reaped us while we
were paused) answers with `Rejected("protocol")`: it is greeted again and the request is
resent on the same socket where it stopped. A worker with a full queue passes a request
that has produced nothing yet to another worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from render_server.worker_client.link import WorkerLink
from render_server.worker_client.request_stream import RequestStream, WorkerError
from render_server.worker_client.routing import Router, continuation
from shared.protocol import Rejected

# Resends of one request to workers that forgot this render server: enough for a pause
# and a worker restart, without looping against a worker that keeps dropping us.
_MAX_RESENDS = 3


class Failover:
    """Moves and resends the requests of one pool's links (`links`: all of them, draining
    and refused ones included), choosing targets with the pool's `router`."""

    def __init__(
        self, links: Callable[[], Sequence[WorkerLink]], router: Router, *, hello: bytes
    ) -> None:
        self.failovers = 0
        """Requests resumed on another worker after theirs was lost."""
        self.resends = 0
        """Requests resent to a worker that had forgotten this render server."""
        self._links = links
        self._router = router
        self._hello = hello

    def evacuate(self, link: WorkerLink) -> int:
        """Move every request in flight on the lost `link` to another live worker, or fail
        it when none is left; how many moved."""
        moved = 0
        for stream in list(link.streams.values()):
            # Aborted there now, so a worker that resumes frees its KV blocks at once.
            link.abort(stream.request_id)
            if self.move(stream, exclude=link):
                moved += 1
            else:
                stream.fail(WorkerError("worker_lost", f"worker {link.address} stopped responding"))
        return moved

    def move(self, stream: RequestStream, exclude: WorkerLink) -> bool:
        """Resume a stream on another live worker than `exclude`; False when there is none."""
        links = [link for link in self._links() if link is not exclude and link.is_routable]
        if not links:
            return False
        loads = [link.load(stream.request.lora_name) for link in links]
        target = links[self._router.choose_failover(stream.request, loads)]
        stream.move_to(target)
        target.track(stream)
        target.send(continuation(stream.request, stream.output_token_ids))
        self.failovers += 1
        return True

    def on_rejected(self, link: WorkerLink, rejected: Rejected) -> None:
        """Resend, move or fail the request the worker behind `link` rejected."""
        stream = link.untrack(rejected.request_id)
        if rejected.code == "protocol":
            # It does not know us (restarted, or reaped us while we were paused):
            # introduce again, then resend on the same socket, which keeps them in order.
            link.say_hello(self._hello)
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
            and stream.num_queue_full < len(self._links())
            and self.move(stream, exclude=link)
        ):
            error = f"worker {link.address} rejected the request: {rejected.message}"
            stream.fail(WorkerError("rejected", error, reject_code=rejected.code))
