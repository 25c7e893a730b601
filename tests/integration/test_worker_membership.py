"""WorkerPool.set_addresses and round-robin routing, against fake workers on loopback:
workers join while serving, and a removed one finishes its streams before it is let go."""

from __future__ import annotations

from render_server.worker_client.pool import WorkerPool
from shared.protocol import Deltas, RequestDelta
from tests.helpers.fake_worker import FAKE_CARD, FakeWorker
from tests.helpers.waiting import wait_until_async
from tests.integration.test_workers_client import collect, greedy, run, tokens


def _pool(addresses: list[str]) -> WorkerPool:
    return WorkerPool(
        addresses,
        tokenizer_digest=FAKE_CARD.tokenizer_digest,
        routing="round_robin",
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=5.0,
    )


def test_workers_join_and_a_removed_one_drains() -> None:
    with FakeWorker() as a, FakeWorker() as b:

        async def main() -> None:
            pool = _pool([a.endpoint])
            await pool.start(ready_timeout_s=5)
            try:
                pool.set_addresses([a.endpoint, b.endpoint])
                await wait_until_async(
                    lambda: [s.alive for s in pool.statuses()] == [True, True], 5, "b to join"
                )
                streams = [await pool.submit(greedy(f"r{i}")) for i in range(4)]
                await wait_until_async(
                    lambda: len(a.request_ids + b.request_ids) == 4, 2, "the Generates"
                )
                assert (a.request_ids, b.request_ids) == (["r0", "r2"], ["r1", "r3"])
                for stream in streams[1:]:
                    await stream.abort()

                # a leaves the set with r0 still running there.
                pool.set_addresses([b.endpoint])
                assert pool.addresses == [b.endpoint]
                assert [(s.address, s.draining) for s in pool.statuses()] == [
                    (a.endpoint, True),
                    (b.endpoint, False),
                ]
                for i in range(4, 6):
                    await (await pool.submit(greedy(f"r{i}"))).abort()
                await wait_until_async(
                    lambda: b.request_ids[-2:] == ["r4", "r5"], 2, "new requests on b"
                )
                assert a.request_ids == ["r0", "r2"]  # nothing new for a draining worker

                a.send(Deltas(deltas=[RequestDelta("r0", [7, 8], finish_reason="length")]))
                deltas = await collect(streams[0])
                assert tokens(deltas) == [7, 8]
                assert deltas[-1].finish_reason == "length"
                await wait_until_async(
                    lambda: [s.address for s in pool.statuses()] == [b.endpoint],
                    2,
                    "the drained worker to be disconnected",
                )

                # Listed again: connected afresh and back in rotation.
                pool.set_addresses([b.endpoint, a.endpoint])
                await wait_until_async(
                    lambda: [s.alive for s in pool.statuses()] == [True, True], 5, "a to rejoin"
                )
                for i in range(6, 8):
                    await (await pool.submit(greedy(f"r{i}"))).abort()
                await wait_until_async(lambda: "r6" in b.request_ids + a.request_ids, 2, "r6")
                await wait_until_async(lambda: "r7" in b.request_ids + a.request_ids, 2, "r7")
                assert {"r6", "r7"} == {b.request_ids[-1], a.request_ids[-1]}
            finally:
                await pool.close()

        run(main())


def test_a_draining_worker_listed_again_stays() -> None:
    with FakeWorker() as a, FakeWorker() as b:

        async def main() -> None:
            pool = _pool([a.endpoint, b.endpoint])
            await pool.start(ready_timeout_s=5)
            try:
                await wait_until_async(
                    lambda: all(s.alive for s in pool.statuses()), 5, "both workers"
                )
                stream = await pool.submit(greedy("long"))  # round robin: on a
                pool.set_addresses([b.endpoint])
                pool.set_addresses([a.endpoint, b.endpoint])  # e.g. a flapping DNS answer
                assert [s.draining for s in pool.statuses()] == [False, False]
                a.send(Deltas(deltas=[RequestDelta("long", [3], finish_reason="stop")]))
                assert tokens(await collect(stream)) == [3]
                assert len(pool.statuses()) == 2
                assert pool.is_ready()
            finally:
                await pool.close()

        run(main())


def test_an_empty_pool_is_not_ready_until_a_worker_is_added() -> None:
    with FakeWorker() as a:

        async def main() -> None:
            pool = _pool([])
            assert not pool.is_ready()
            pool.set_addresses([a.endpoint])  # before start: start() connects it
            await pool.start(ready_timeout_s=5)
            try:
                assert pool.is_ready()
                pool.set_addresses([])
                assert not pool.is_ready()
            finally:
                await pool.close()

        run(main())
