"""A stand-in for DNS in the discovery tests (`--worker-dns-resolver
tests.e2e.resolver_stub:resolve`): the "host" of `--worker-dns FILE:PORT` is a file
listing one worker address per line, read again at every resolution."""

from __future__ import annotations

from pathlib import Path


def resolve(host: str, port: int) -> list[str]:
    return Path(host).read_text().split()
