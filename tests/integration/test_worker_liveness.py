"""Client liveness between a real WorkerServer and a real WorkerPool over loopback ZMQ,
with a scripted engine whose step length the test controls.

A long engine step must not make a heartbeating render server look silent, a render
server the worker did reap (it was paused) must resume its streams by itself, and a
request the worker cannot read is refused, not left unanswered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from gpu_worker.engine.errors import RequestRejected
from gpu_worker.server.zmq_server import WorkerServer
from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.model_card import ModelCard
from shared.protocol import Generate, RequestDelta, WorkerStats
from shared.sampling import SamplingParams

CARD = ModelCard(
    model_id="scripted",
    tokenizer_digest="scripted-digest",
    vocab_size=100_000,
    eos_token_ids=[0],
    max_model_len=100_000,
)


class ScriptedEngine:
    """Each step sleeps `step_s` (step number `slow_step` sleeps `slow_step_s`), then gives
    every request one token: the length of its sequence so far, so a resumed request's
    output is the same run of consecutive ids as an uninterrupted one."""

    model_card = CARD

    def __init__(self, step_s: float, slow_step: int = -1, slow_step_s: float = 0) -> None:
        self.step_s = step_s
        self.slow_step = slow_step
        self.slow_step_s = slow_step_s
        self.sequences: dict[str, tuple[str, int, int]] = {}
        """key -> (request id, sequence length, tokens left)"""
        self.steps = 0

    def add_request(self, request: Generate, request_key: str) -> None:
        if request_key in self.sequences:
            raise RequestRejected("duplicate", "already running")
        self.sequences[request_key] = (
            request.request_id,
            len(request.prompt_token_ids),
            request.sampling.max_tokens,
        )

    def abort(self, request_keys: list[str]) -> None:
        for key in request_keys:
            self.sequences.pop(key, None)

    def step(self) -> list[RequestDelta]:
        time.sleep(self.slow_step_s if self.steps == self.slow_step else self.step_s)
        self.steps += 1
        deltas = []
        for key, (request_id, length, left) in list(self.sequences.items()):
            finished = left == 1
            deltas.append(
                RequestDelta(
                    request_id=key,
                    new_token_ids=[length],
                    finish_reason="length" if finished else None,
                )
            )
            if finished:
                del self.sequences[key]
            else:
                self.sequences[key] = (request_id, length + 1, left - 1)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    def stats(self) -> WorkerStats:
        return WorkerStats(num_running=len(self.sequences))


@contextmanager
def running_server(engine: ScriptedEngine, client_timeout_s: float) -> Iterator[WorkerServer]:
    server = WorkerServer(
        engine,
        "tcp://127.0.0.1:*",
        worker_id="scripted",
        heartbeat_interval_s=0.1,
        client_timeout_s=client_timeout_s,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)


@asynccontextmanager
async def started_pool(address: str) -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(
        [address],
        tokenizer_digest=CARD.tokenizer_digest,
        client_id="test",
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=1.0,
    )
    try:
        await pool.start(ready_timeout_s=10)
        yield pool
    finally:
        await pool.close()


def request(request_id: str, max_tokens: int) -> Generate:
    return Generate(
        request_id=request_id,
        prompt_token_ids=[5] * 10,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def collect_tokens(pool: WorkerPool, generate: Generate, *, stall_s: float = 0) -> list[int]:
    """Submit and gather every token id; with `stall_s`, block this loop that long once
    15 tokens arrived (as a SIGSTOP of the render process would). 15 steps of 20 ms: the
    pool has sent heartbeats by then, so the worker treats its silence as a client gone."""
    stream = await pool.submit(generate)
    tokens: list[int] = []
    async with asyncio.timeout(15):
        async for delta in stream:
            tokens.extend(delta.new_token_ids)
            if stall_s and len(tokens) >= 15:
                time.sleep(stall_s)  # the whole loop stops: no heartbeats, no reading
                stall_s = 0
    assert stream.finish_reason == "length"
    return tokens


def test_a_step_longer_than_the_client_timeout_reaps_no_one() -> None:
    """The render server's heartbeats arrive during a 1.5 s step (the 16th, so heartbeats
    have started); the worker's client timeout is 0.5 s. Its request must finish, and no
    client be reaped."""
    engine = ScriptedEngine(step_s=0.02, slow_step=15, slow_step_s=1.5)
    with running_server(engine, client_timeout_s=0.5) as server:

        async def main() -> list[int]:
            async with started_pool(server.endpoint) as pool:
                return await collect_tokens(pool, request("long-step", 20))

        assert asyncio.run(main()) == list(range(10, 30))
        assert server.counters.reaped_clients == 0


def test_a_paused_render_server_is_reaped_then_resumes_its_stream() -> None:
    """The render loop stops for 1.5 s (worker client timeout 0.5 s): the worker aborts
    its request and says so; on waking, the pool greets again and resends the request
    where it stopped, so the stream ends complete, with no token lost or repeated."""
    engine = ScriptedEngine(step_s=0.02)
    with running_server(engine, client_timeout_s=0.5) as server:

        async def main() -> tuple[list[int], int]:
            async with started_pool(server.endpoint) as pool:
                tokens = await collect_tokens(pool, request("paused", 40), stall_s=1.5)
                # The next request on the same pool is served as usual.
                assert await collect_tokens(pool, request("after", 2)) == [10, 11]
                return tokens, pool.resends

        tokens, resends = asyncio.run(main())
        assert tokens == list(range(10, 50))
        assert server.counters.reaped_clients == 1
        assert resends == 1


def test_a_generate_that_fails_to_decode_is_refused_not_left_unanswered() -> None:
    """A Generate the worker cannot decode (a negative stop token id) but whose request
    id is readable gets a Rejected, so its stream ends with an error instead of waiting."""
    engine = ScriptedEngine(step_s=0.01)
    with running_server(engine, client_timeout_s=5) as server:

        async def main() -> None:
            async with started_pool(server.endpoint) as pool:
                bad = request("bad", 3)
                bad.sampling.stop_token_ids = [-1]  # passes no validator on this side
                stream = await pool.submit(bad)
                with pytest.raises(WorkerError) as caught:
                    async with asyncio.timeout(5):
                        await stream.accepted()
                assert caught.value.reject_code == "invalid_request"

        asyncio.run(main())
        assert server.counters.bad_frames == 1
