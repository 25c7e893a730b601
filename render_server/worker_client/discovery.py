"""Worker discovery: every address behind DNS names, re-resolved on a timer.

A Kubernetes headless Service has one A/AAAA record per ready pod, so resolving its name
lists every gpu-worker; resolving it again every `interval_s` follows scale-ups, rollouts
and failures without restarting the render server. New addresses join the pool; ones that
vanished are drained there (no new requests, closed once their streams end).

The resolver is injectable (`Resolver`), so the policy is tested without DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], list[str]]
"""(host, port) -> the ZMQ address of every worker behind the name. Blocking (it runs in
a thread); raises OSError when the name does not resolve."""


class AddressSink(Protocol):
    """What discovery feeds: `WorkerPool` (a protocol so tests can pass a stub)."""

    def set_addresses(self, addresses: list[str]) -> None: ...


def parse_host_port(name: str) -> tuple[str, int]:
    """Split `HOST:PORT` (`[v6addr]:PORT` for a literal IPv6 host); ValueError if malformed."""
    host, sep, port_text = name.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"expected HOST:PORT, got {name!r}")
    return host, int(port_text)


def resolve_tcp(host: str, port: int) -> list[str]:
    """Every A and AAAA record of `host` as `tcp://IP:PORT`, deduplicated and sorted (DNS
    servers rotate the order of their answers; a stable order keeps logs quiet)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = {
        f"tcp://[{sockaddr[0]}]:{port}"
        if family == socket.AF_INET6
        else f"tcp://{sockaddr[0]}:{port}"
        for family, _, _, _, sockaddr in infos
    }
    return sorted(addresses)


def load_resolver(spec: str | None) -> Resolver:
    """`resolve_tcp`, or the `module:function` named by the testing hook
    `--worker-dns-resolver` (so tests can change the answers without a DNS server)."""
    if spec is None:
        return resolve_tcp
    module_name, _, attribute = spec.partition(":")
    resolver = getattr(importlib.import_module(module_name), attribute)
    if not callable(resolver):
        raise TypeError(f"{spec} is not callable")
    return resolver


class WorkerDiscovery:
    """Keeps `pool`'s addresses equal to `static` plus everything `names` resolve to.

    A name that fails to resolve keeps its last answer: a DNS hiccup must not drain every
    worker (the pool's heartbeats already notice workers that really went away).
    """

    def __init__(
        self,
        pool: AddressSink,
        names: Sequence[str],
        *,
        static: Sequence[str] = (),
        interval_s: float = 10.0,
        resolver: Resolver = resolve_tcp,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.names = [parse_host_port(name) for name in names]
        self.static = list(static)
        self.interval_s = interval_s
        self.addresses: list[str] | None = None
        """What the pool was last given (None before the first refresh)."""
        self._pool = pool
        self._resolver = resolver
        self._answers: dict[tuple[str, int], list[str]] = {}
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> list[str]:
        """Resolve every name once and hand the pool the union; returns it."""
        for host, port in self.names:
            try:
                self._answers[(host, port)] = await asyncio.to_thread(self._resolver, host, port)
            except OSError as exc:
                logger.warning("cannot resolve workers at %s:%d: %s", host, port, exc)
        resolved = [address for answer in self._answers.values() for address in answer]
        addresses = list(dict.fromkeys([*self.static, *resolved]))
        if addresses != self.addresses:
            logger.info("workers: %s", ", ".join(addresses) or "none")
            self.addresses = addresses
            self._pool.set_addresses(addresses)
        return addresses

    def start(self) -> None:
        """Re-resolve every `interval_s` in the background until `close()`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="duet-worker-discovery"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # the loop must outlive a bug or a bad resolver answer
                logger.exception("worker discovery round failed")
