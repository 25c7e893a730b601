"""One request's deltas from a worker, for a single consumer; and the error it ends with.

The pool pushes deltas as frames arrive (`push`, `fail`) and moves a stream to another
worker on failover (`move_to`); the consumer iterates, and deltas that queued up while it
was busy come merged into one (`shared.protocol.merge_delta`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Literal, Protocol

from shared.protocol import FinishReason, Generate, RequestDelta, merge_delta

WorkerErrorCode = Literal["rejected", "worker_lost", "no_workers", "timeout", "shutdown"]


class WorkerError(Exception):
    """A request or the pool could not be served by a worker.

    `code` is "rejected" (the worker refused the request; `reject_code` says why),
    "worker_lost" (its worker stopped answering), "no_workers" (none is usable),
    "timeout" (its deadline passed) or "shutdown" (this server stopped it on its way out).
    """

    def __init__(
        self, code: WorkerErrorCode, message: str, *, reject_code: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reject_code = reject_code


class StreamOwner(Protocol):
    """The worker link a stream runs on: where an Abort goes."""

    address: str

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The deltas of one request, in order, for a single consumer.

    Iterate it (`async for delta in stream`); deltas that queued up while the consumer
    was busy come merged into one. Iteration ends after the delta carrying
    `finish_reason` and raises `WorkerError` if the worker rejected the request or was
    lost. Leaving the iteration early, being cancelled, `abort()` or leaving
    `async with stream:` sends Abort if the request is still running.

    `request` and `output_token_ids` (everything received so far, consumed or not) are
    what a resend elsewhere needs: see `render_server.worker_client.routing.continuation`.
    `accepted()` waits until a worker has taken the request (or it ended), so an HTTP
    answer can wait for that before it commits to a status.
    """

    def __init__(self, request: Generate, link: StreamOwner) -> None:
        self.request_id = request.request_id
        self.worker_address = link.address
        self.request = request
        self.output_token_ids: list[int] = []
        self.num_queue_full = 0
        """Workers that refused it with a full queue (each is tried at most once)."""
        self.num_resends = 0
        """Times it was resent to a worker that had forgotten this render server."""
        self.is_accepted = False
        """A worker acknowledged it (or sent a delta): it runs, or ran, somewhere."""
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

    async def accepted(self) -> None:
        """Return once a worker has taken the request, or it finished or was aborted;
        raise its `WorkerError` if it failed first."""
        while not self.is_accepted and not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None and not self.is_accepted:
            raise self._error

    def stop(self, error: WorkerError) -> None:
        """Abort the request on its worker and end the iteration with `error` (a deadline
        passed, the server is going away)."""
        if self._ended:
            return
        self._link.abort(self.request_id)
        self.fail(error)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._cancel()

    # ---- called by the pool -----------------------------------------------------------

    def acknowledge(self) -> None:
        """The worker took the request (its empty first delta)."""
        if not self.is_accepted:
            self.is_accepted = True
            self._wake()

    def push(self, delta: RequestDelta) -> None:
        self.is_accepted = True
        self._pending.append(delta)
        self.output_token_ids.extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self._ended = True
        self._wake()

    def move_to(self, link: StreamOwner) -> None:
        """Continue on another worker (failover): later deltas and the Abort go there."""
        self._link = link
        self.worker_address = link.address

    def fail(self, error: WorkerError) -> None:
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
            merge_delta(delta, pending.popleft())
        return delta
