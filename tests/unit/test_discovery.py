"""Worker discovery with an injected resolver: no DNS, no sockets, milliseconds."""

from __future__ import annotations

import asyncio
import socket

import pytest

from render_server.worker_client.discovery import WorkerDiscovery, parse_host_port, resolve_tcp
from tests.helpers.waiting import wait_until_async


class RecordingPool:
    """Stands in for WorkerPool: remembers every set of addresses it was given."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def set_addresses(self, addresses: list[str]) -> None:
        self.calls.append(addresses)


class ScriptedResolver:
    """Answers each name from a dict the test changes between refreshes; a missing name
    fails like NXDOMAIN."""

    def __init__(self, answers: dict[tuple[str, int], list[str]]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if (host, port) not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.answers[(host, port)])


def test_parse_host_port() -> None:
    assert parse_host_port("workers.duet.svc:5555") == ("workers.duet.svc", 5555)
    assert parse_host_port("[fd00::1]:7") == ("fd00::1", 7)
    for bad in ("workers", "workers:", ":5555", "workers:port", "workers:0", "w:70000"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_host_port(bad)


def test_resolve_tcp_formats_ipv4_and_ipv6_addresses() -> None:
    # Numeric hosts resolve without a DNS server.
    assert resolve_tcp("127.0.0.1", 5555) == ["tcp://127.0.0.1:5555"]
    if socket.has_ipv6:
        assert resolve_tcp("::1", 5555) == ["tcp://[::1]:5555"]


def test_the_pool_follows_the_answers() -> None:
    name = ("workers.svc", 5555)
    resolver = ScriptedResolver({name: ["tcp://10.0.0.1:5555"]})
    pool = RecordingPool()
    discovery = WorkerDiscovery(pool, ["workers.svc:5555"], resolver=resolver)

    async def main() -> None:
        assert await discovery.refresh() == ["tcp://10.0.0.1:5555"]
        resolver.answers[name] = ["tcp://10.0.0.2:5555", "tcp://10.0.0.1:5555"]  # scale up
        await discovery.refresh()
        await discovery.refresh()  # unchanged: the pool is not bothered
        resolver.answers[name] = ["tcp://10.0.0.2:5555"]  # 10.0.0.1 went away
        await discovery.refresh()

    asyncio.run(main())
    assert pool.calls == [
        ["tcp://10.0.0.1:5555"],
        ["tcp://10.0.0.2:5555", "tcp://10.0.0.1:5555"],
        ["tcp://10.0.0.2:5555"],
    ]
    assert resolver.asked == [name] * 4


def test_a_failed_lookup_keeps_the_last_answer_and_static_workers_stay() -> None:
    a, b = ("a.svc", 1), ("b.svc", 2)
    resolver = ScriptedResolver({a: ["tcp://10.0.0.1:1"], b: ["tcp://10.0.1.1:2"]})
    pool = RecordingPool()
    discovery = WorkerDiscovery(
        pool, ["a.svc:1", "b.svc:2"], static=["ipc:///run/local.sock"], resolver=resolver
    )

    async def main() -> None:
        await discovery.refresh()
        del resolver.answers[a]  # a DNS hiccup for one name
        resolver.answers[b] = []  # the other name now has no workers
        await discovery.refresh()

    asyncio.run(main())
    assert pool.calls == [
        ["ipc:///run/local.sock", "tcp://10.0.0.1:1", "tcp://10.0.1.1:2"],
        ["ipc:///run/local.sock", "tcp://10.0.0.1:1"],
    ]


def test_a_name_that_never_resolved_gives_only_the_static_workers() -> None:
    pool = RecordingPool()
    discovery = WorkerDiscovery(pool, ["nowhere.svc:1"], resolver=ScriptedResolver({}))
    assert asyncio.run(discovery.refresh()) == []
    assert pool.calls == [[]]


def test_start_re_resolves_every_interval_until_closed() -> None:
    name = ("w.svc", 9)
    resolver = ScriptedResolver({name: ["tcp://10.0.0.1:9"]})
    pool = RecordingPool()
    discovery = WorkerDiscovery(pool, ["w.svc:9"], interval_s=0.01, resolver=resolver)

    async def main() -> None:
        await discovery.refresh()
        discovery.start()
        resolver.answers[name] = ["tcp://10.0.0.1:9", "tcp://10.0.0.3:9"]
        await wait_until_async(
            lambda: len(pool.calls) == 2, 5, "the second resolution", interval_s=0.01
        )
        await discovery.close()
        asked = len(resolver.asked)
        await asyncio.sleep(0.05)
        assert len(resolver.asked) == asked  # closed: no more lookups

    asyncio.run(main())
    assert pool.calls[-1] == ["tcp://10.0.0.1:9", "tcp://10.0.0.3:9"]
