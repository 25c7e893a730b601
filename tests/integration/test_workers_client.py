"""render_server.worker_client.pool against real gpu-worker processes (and a fake ROUTER) on
loopback.

Two workers start once for the module. Each test drives its own WorkerPool inside
`asyncio.run`, so no pytest-asyncio is needed; every pool is closed before the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import zmq

from render_server.worker_client.pool import RequestStream, WorkerError, WorkerPool
from shared.protocol import (
    MAGIC,
    Deltas,
    Encoder,
    Generate,
    Hello,
    RequestDelta,
    Welcome,
    WorkerMessageDecoder,
)
from shared.sampling import SamplingParams
from shared.transport import make_dealer
from tests.helpers.fake_worker import FAKE_CARD, FakeWorker
from tests.helpers.processes import (
    SMALL_WORKER,
    WorkerProcess,
    spawn_worker,
    stop_worker,
    wait_worker_ready,
)
from tests.helpers.waiting import wait_until_async

PROMPT = [1, 4093, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
STARTUP_TIMEOUT_S = 180
TEST_TIMEOUT_S = 120
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test's coroutine on a fresh loop, bounded so a hang fails instead."""
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


@dataclass
class Workers:
    """The module's two gpu-worker processes."""

    a: str
    b: str
    process_b: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    # Both load the model at the same time: startup is most of this module's runtime.
    processes = [spawn_worker(None, **SMALL_WORKER), spawn_worker(None, **SMALL_WORKER)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    started: list[WorkerProcess] = []
    try:
        for process in processes:
            started.append(wait_worker_ready(process, None, deadline))
        a, b = started
        yield Workers(a.address, b.address, b.process)
    finally:
        # A worker never waited for (an earlier one failed to start) has nothing to drain.
        for process in processes[len(started) :]:
            process.kill()
            process.wait()
        # stop_worker continues a worker a test left SIGSTOPped before terminating it.
        exit_codes = [stop_worker(worker, timeout_s=30) for worker in started]
        assert exit_codes == [0] * len(started), exit_codes


@pytest.fixture(scope="module")
def digest(workers: Workers) -> str:
    """The workers' tokenizer digest, as a render server with the same tokenizer has it."""
    context = zmq.Context()
    socket = make_dealer(context, workers.a, identity=uuid.uuid4().bytes)
    try:
        socket.send(Encoder().encode(Hello(client_id="digest")))
        decoder = WorkerMessageDecoder()
        while True:
            assert socket.poll(30_000), "no Welcome"
            message = decoder.decode(socket.recv())
            if isinstance(message, Welcome):
                return message.model_card.tokenizer_digest
    finally:
        socket.close()
        context.term()


@contextlib.asynccontextmanager
async def started_pool(
    addresses: list[str], digest: str, heartbeat_timeout_s: float = 10.0
) -> AsyncIterator[WorkerPool]:
    # A generous timeout by default: a busy CI box must not make a slow step look like
    # a dead worker, except in the test about exactly that.
    pool = WorkerPool(
        addresses,
        tokenizer_digest=digest,
        client_id="test",
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    try:
        await pool.start(ready_timeout_s=30)
        await wait_until_async(
            lambda: all(s.alive for s in pool.statuses()), 10, "every worker alive"
        )
        yield pool
    finally:
        await pool.close()


def greedy(
    request_id: str, prompt: list[int] = PROMPT, max_tokens: int = 12, **kw: Any
) -> Generate:
    return Generate(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw),
    )


def long_request(request_id: str) -> Generate:
    return greedy(request_id, max_tokens=400, ignore_eos=True)


async def collect(stream: RequestStream) -> list[RequestDelta]:
    return [delta async for delta in stream]


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.new_token_ids]


async def assert_worker_idle(pool: WorkerPool, address: str, within_s: float = 2.0) -> None:
    """A heartbeat sent after now shows nothing running and every KV block free."""
    since = time.time()

    def idle() -> bool:
        [status] = [s for s in pool.statuses() if s.address == address]
        stats = status.stats
        return (
            status.last_heartbeat > since
            and stats is not None
            and stats.num_running == 0
            and stats.kv_blocks_free == stats.kv_blocks_total
        )

    await wait_until_async(idle, within_s, f"worker {address} to free its KV blocks")


# ---- one worker -----------------------------------------------------------------------


def test_handshake_and_model_card(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a], digest) as pool:
            card = pool.model_card
            assert card is not None
            assert card.vocab_size == 49152
            assert card.tokenizer_digest == digest
            assert pool.is_ready()
            [status] = pool.statuses()
            assert status.address == workers.a
            assert status.worker_id
            assert status.connected
            assert status.alive
            assert not status.refused
            assert status.model_card == card
            assert status.outstanding == 0
            await wait_until_async(lambda: pool.statuses()[0].stats is not None, 3, "a heartbeat")

    run(main())


def test_greedy_request_streams_to_completion_twice_alike(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a], digest) as pool:
            first = await pool.submit(greedy("g1"))
            assert first.request_id == "g1"
            assert first.worker_address == workers.a
            deltas = await collect(first)
            assert deltas[-1].finish_reason in ("stop", "length")
            assert all(d.finish_reason is None for d in deltas[:-1])
            assert deltas[-1].num_prompt_tokens == len(PROMPT)
            assert 1 <= len(tokens(deltas)) <= 12
            assert first.output_token_ids == tokens(deltas)
            assert first.is_finished
            again = await collect(await pool.submit(greedy("g2")))
            assert tokens(again) == tokens(deltas)
            assert pool.statuses()[0].outstanding == 0

    run(main())


def test_abort_mid_stream_frees_the_worker(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a], digest) as pool:
            stream = await pool.submit(long_request("to-abort"))
            iterator = aiter(stream)
            first = await anext(iterator)
            assert first.finish_reason is None
            await stream.abort()
            await stream.abort()  # idempotent
            rest = [delta async for delta in iterator]
            assert rest[-1].finish_reason == "abort"
            assert stream.is_finished
            assert stream.finish_reason == "abort"
            assert pool.statuses()[0].outstanding == 0
            await assert_worker_idle(pool, workers.a)

    run(main())


def test_leaving_early_aborts(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a], digest) as pool:
            # leaving `async with` before the end
            async with await pool.submit(long_request("with")) as stream:
                async for _ in stream:
                    break
            assert stream.is_finished
            assert stream.finish_reason == "abort"
            # `break` out of a bare `async for`: the closed generator aborts
            bare = await pool.submit(long_request("bare"))
            async for _ in bare:
                break
            await wait_until_async(lambda: bare.is_finished, 1, "the abandoned iterator to abort")
            # a cancelled consumer
            cancelled = await pool.submit(long_request("cancelled"))
            consumer = asyncio.create_task(collect(cancelled))
            await wait_until_async(lambda: bool(cancelled.output_token_ids), 30, "the first token")
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            assert cancelled.is_finished
            assert cancelled.finish_reason == "abort"
            assert pool.statuses()[0].outstanding == 0
            await assert_worker_idle(pool, workers.a)

    run(main())


def test_rejected_request_raises(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a], digest) as pool:
            stream = await pool.submit(greedy("oov", prompt=[49152], max_tokens=2))
            with pytest.raises(WorkerError) as info:
                await collect(stream)
            assert info.value.code == "rejected"
            assert info.value.reject_code == "invalid_request"
            assert stream.is_finished
            assert pool.is_ready()
            assert await collect(await pool.submit(greedy("after-oov", max_tokens=2)))

    run(main())


def test_worker_with_another_tokenizer_is_refused(workers: Workers, digest: str) -> None:
    async def main() -> None:
        for kwargs in (
            {"tokenizer_digest": "0" * 64},
            {"tokenizer_digest": digest, "model_id": "x"},
        ):
            pool = WorkerPool([workers.a], **kwargs)
            try:
                with pytest.raises(WorkerError) as info:
                    await pool.start(ready_timeout_s=1)
                assert info.value.code == "no_workers"
                assert "refused" in info.value.message
                [status] = pool.statuses()
                assert status.refused
                assert not status.connected
                assert not status.alive
                assert not pool.is_ready()
                assert pool.model_card is None
                with pytest.raises(WorkerError) as info:
                    await pool.submit(greedy("nowhere"))
                assert info.value.code == "no_workers"
            finally:
                await pool.close()

    run(main())


# ---- two workers ----------------------------------------------------------------------


def test_concurrent_requests_spread_over_both_workers(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with started_pool([workers.a, workers.b], digest) as pool:
            # Distinct first blocks, so prefix affinity has nothing to say.
            streams = [
                await pool.submit(greedy(f"c{i}", prompt=[100 + i, *PROMPT[1:]], max_tokens=8))
                for i in range(20)
            ]
            outstanding = [s.outstanding for s in pool.statuses()]
            assert sum(outstanding) == 20, outstanding
            assert min(outstanding) >= 5, outstanding
            results = await asyncio.gather(*(collect(s) for s in streams))
            for deltas in results:
                assert deltas[-1].finish_reason in ("stop", "length")
                assert tokens(deltas)
            assert {s.worker_address for s in streams} == {workers.a, workers.b}

    run(main())


def test_prefix_affinity_sends_a_repeated_prompt_to_the_same_worker(
    workers: Workers, digest: str
) -> None:
    long_prompt = [(7 * i + 300) % 40000 for i in range(90)]  # five full blocks

    async def main() -> None:
        async with started_pool([workers.a, workers.b], digest) as pool:
            # Load counts the heartbeats' running requests, and a heartbeat can still show
            # the last test's: the affinity would rightly give way to an idle worker then.
            for address in (workers.a, workers.b):
                await assert_worker_idle(pool, address, within_s=10)
            used, cached = set(), []
            for i in range(4):
                # an unrelated request first, so plain least-load would alternate
                await collect(await pool.submit(greedy(f"other{i}", prompt=[i + 1], max_tokens=1)))
                stream = await pool.submit(greedy(f"p{i}", prompt=long_prompt, max_tokens=2))
                used.add(stream.worker_address)
                cached.append((await collect(stream))[-1].num_cached_tokens)
            assert len(used) == 1
            assert all(n >= 80 for n in cached[1:]), cached  # its KV cache had the prefix

    run(main())


def test_stopped_worker_is_lost_then_comes_back(workers: Workers, digest: str) -> None:
    async def main() -> None:
        async with (
            started_pool([workers.b], digest, heartbeat_timeout_s=3.0) as only_b,
            started_pool([workers.a, workers.b], digest, heartbeat_timeout_s=3.0) as both,
        ):
            stream = await only_b.submit(long_request("doomed"))
            iterator = aiter(stream)
            await anext(iterator)
            os.kill(workers.process_b.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                with pytest.raises(WorkerError) as info:
                    async for _ in iterator:
                        pass
                lost_after = time.monotonic() - stopped_at
                assert info.value.code == "worker_lost"
                assert lost_after <= only_b.heartbeat_timeout_s + 1.0, lost_after
                assert not only_b.is_ready()
                assert not only_b.statuses()[0].alive
                with pytest.raises(WorkerError):
                    await only_b.submit(greedy("while-stopped"))
                await wait_until_async(
                    lambda: not both.statuses()[1].alive, 2, "the second pool to notice"
                )
                assert both.is_ready()
                survivor = await both.submit(greedy("to-a", max_tokens=2))
                assert survivor.worker_address == workers.a
                assert await collect(survivor)
            finally:
                os.kill(workers.process_b.pid, signal.SIGCONT)
            await wait_until_async(only_b.is_ready, 5, "the worker to come back")
            await wait_until_async(lambda: both.statuses()[1].alive, 5, "the worker to come back")
            deltas = await collect(await only_b.submit(greedy("after", max_tokens=2)))
            assert deltas[-1].finish_reason in ("stop", "length")
            await assert_worker_idle(only_b, workers.b, within_s=3.0)

    run(main())


# ---- against a fake worker (tests/helpers/fake_worker) -------------------------------


def test_garbage_frames_are_counted_not_fatal() -> None:
    garbage = [
        [b""],
        [b"garbage"],
        [MAGIC + bytes([99]) + b"\x80"],
        [MAGIC + b"\x01\xc1"],
        [b"two", b"frames"],
    ]
    with FakeWorker(before_welcome=garbage) as fake:

        async def main() -> None:
            async with started_pool([fake.endpoint], FAKE_CARD.tokenizer_digest) as pool:
                assert pool.bad_frames == len(garbage)
                assert pool.is_ready()
                assert pool.model_card == FAKE_CARD
                fake.send_raw([b"more garbage"])
                await wait_until_async(
                    lambda: pool.bad_frames == len(garbage) + 1, 2, "the late frame"
                )
                assert pool.is_ready()

        run(main())


def test_deltas_queued_behind_a_slow_consumer_arrive_merged() -> None:
    with FakeWorker() as fake:

        async def main() -> None:
            async with started_pool([fake.endpoint], FAKE_CARD.tokenizer_digest) as pool:
                stream = await pool.submit(greedy("m", prompt=[5, 6, 7]))
                await wait_until_async(lambda: fake.request_ids == ["m"], 2, "the Generate")
                first = RequestDelta("m", [1], num_prompt_tokens=3, queue_time=0.5)
                second = RequestDelta("m", [2, 3], num_cached_tokens=0)
                last = RequestDelta("m", [4], finish_reason="length", stop_token_id=None)
                for delta in (first, second, last):
                    fake.send(Deltas(deltas=[delta, RequestDelta("unknown", [9])]))
                await wait_until_async(lambda: stream.is_finished, 2, "the last delta")
                [merged] = await collect(stream)
                assert merged.new_token_ids == [1, 2, 3, 4]
                assert merged.finish_reason == "length"
                assert merged.num_prompt_tokens == 3
                assert merged.queue_time == 0.5
                assert pool.unknown_deltas == 3

        run(main())


def test_a_restarted_worker_is_greeted_again() -> None:
    async def main() -> None:
        with FakeWorker() as first:
            address = first.endpoint
            pool = WorkerPool(
                [address],
                tokenizer_digest=FAKE_CARD.tokenizer_digest,
                heartbeat_interval_s=0.2,
                heartbeat_timeout_s=0.6,
            )
            await pool.start(ready_timeout_s=5)
        try:
            await wait_until_async(
                lambda: not pool.is_ready(), 2, "the stopped worker to be marked dead"
            )
            with FakeWorker(bind=address) as second:  # a new process: it never saw our Hello
                await wait_until_async(pool.is_ready, 3, "the restarted worker to welcome us")
                stream = await pool.submit(greedy("after-restart"))
                await wait_until_async(
                    lambda: second.request_ids == ["after-restart"], 2, "the Generate"
                )
                await stream.abort()
        finally:
            await pool.close()

    run(main())
