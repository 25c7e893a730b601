"""Whether each gpu-worker still answers, as the pool's one monitor task decides it.

The monitor sends `ClientHeartbeat`s at their interval, re-sends `Hello` to workers that
have not (or no longer) answered, and hands the pool a worker whose messages stopped for
`timeout_s`, but not for the time this process itself was paused (SIGSTOP, a VM pause, a
loop stall): the silence was ours, so every worker's timeout starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from render_server.worker_client.link import WorkerLink
from shared.protocol import ClientHeartbeat, RenderToWorker

logger = logging.getLogger(__name__)


class LivenessMonitor:
    """The rounds of one pool's monitor task (`run`), over the links the pool lists.

    `on_silent` gets each live link silent past `timeout_s`; `after_round` runs at the end
    of every round (the pool closes drained links there).
    """

    def __init__(
        self,
        links: Callable[[], Sequence[WorkerLink]],
        *,
        interval_s: float,
        timeout_s: float,
        encode: Callable[[RenderToWorker], bytes],
        hello: bytes,
        on_silent: Callable[[WorkerLink], None],
        after_round: Callable[[], None],
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._links = links
        self._encode = encode
        self._hello = hello
        self._on_silent = on_silent
        self._after_round = after_round

    async def run(self) -> None:
        """Until cancelled. The pool has greeted every link before this starts."""
        # Liveness is checked a few times per timeout, so a dead worker is noticed at most
        # an eighth of the timeout late; heartbeats go out at their own interval.
        period = min(self.interval_s, self.timeout_s / 8)
        next_beat = time.monotonic() + self.interval_s  # the pool's start() sent Hello
        last_round = time.monotonic()
        while True:
            try:
                now = time.monotonic()
                if now - last_round > period + self.timeout_s / 2:
                    self._after_pause(now - last_round)
                last_round = now
                if now >= next_beat:
                    next_beat = now + self.interval_s
                    self._send_heartbeats()
                for link in self._links():
                    if link.alive and link.seconds_silent(now) > self.timeout_s:
                        self._on_silent(link)
                self._after_round()
            except Exception:  # the monitor must outlive any bug in one round
                logger.exception("worker monitor round failed")
            await asyncio.sleep(period)

    def _after_pause(self, paused_s: float) -> None:
        """This process did not run for `paused_s`: its workers' silence over that time says
        nothing about them. Each gets a fresh full timeout, starting with what arrived
        meanwhile."""
        logger.warning("this render process was paused for %.1fs", paused_s)
        now = time.monotonic()
        for link in self._links():
            link.forgive_silence(now)

    def _send_heartbeats(self) -> None:
        beat = self._encode(ClientHeartbeat(sent_at=time.time()))
        now = time.monotonic()
        for link in self._links():
            if link.refused:
                continue
            link.flush_backlog()
            if link.alive:
                link.send_frame(beat)
            elif link.seconds_since_hello(now) >= self.timeout_s:
                # Not (or no longer) answering: it may have restarted and forgotten us.
                # Not every beat, since ZMQ queues them all for a worker that is down.
                link.say_hello(self._hello)
