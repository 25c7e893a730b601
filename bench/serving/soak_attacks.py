"""The attacker mix of bench/serving/soak.py: what a hostile or broken client does beside the normal
traffic, each in its own loop until the soak ends, and a /health probe that times the
server's event loop meanwhile.

- slow sockets: connections that trickle their headers, trickle a body, or send nothing;
  the server must close each (header / body / keep-alive timeouts), never serve it;
- huge headers: a head of many megabytes; the answer must be a 431 (or a close) at once;
- deep JSON: 100,000 nested arrays in a chat message; the answer must be a 400;
- long prompts: near the context length; an answer (200) or a proper error;
- pauses: the render process is stopped (SIGSTOP) for a few seconds, then continued; the
  worker drops it meanwhile, and its streams must resume.

Each attack's outcome is "ok" (handled as it must be) or "lost" with a reason.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class AttackTally:
    """Outcome of every attack, by kind, and the reasons of the ones that went wrong."""

    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, kind: str, ok: bool, detail: str = "") -> None:
        key = (kind, "ok" if ok else "lost")
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if not ok:
            self.failures.append(f"{kind}: {detail}"[:300])

    def count(self, kind: str, outcome: str) -> int:
        return self.outcomes.get((kind, outcome), 0)


@dataclass
class HealthProbe:
    """GET /health every `every_s` on its own connection; latencies with their start time."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic start, seconds to answer; inf when it failed)"""
    pauses: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of the windows the render process was stopped on purpose."""

    def latencies_outside_pauses(self) -> list[float]:
        """Samples that did not overlap a pause (a stopped process answers nothing)."""
        return [
            latency
            for started, latency in self.samples
            if not any(a - 1.0 <= started <= b for a, b in self.pauses)
        ]


async def probe_health(base_url: str, probe: HealthProbe, until: float, every_s: float) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                ok = (await http.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            probe.samples.append((started, time.monotonic() - started if ok else float("inf")))
            await asyncio.sleep(every_s)


# ---- slow sockets ---------------------------------------------------------------------


def _head(path: str, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: soak\r\n{extra}".encode()


async def _slow_socket(host: str, port: int, style: str, limit_s: float) -> tuple[bool, str]:
    """One slow connection; ok when the server closes it within `limit_s` without having
    served it (a 408 or a bare close)."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    try:
        if style == "header":
            payload = _head("/health") + b"X-Slow: " + b"a" * 10_000
        elif style == "body":
            head = _head("/v1/chat/completions", "POST", "Content-Length: 100000\r\n\r\n")
            writer.write(head)
            payload = b"{" + b" " * 99_999
        else:  # idle: connect and say nothing
            payload = b""
        answer = b""
        sent = 0
        while time.monotonic() - started < limit_s:
            if sent < len(payload):
                writer.write(payload[sent : sent + 1])
                sent += 1
            try:
                chunk = await asyncio.wait_for(reader.read(4096), timeout=0.5)
            except TimeoutError:
                continue
            if chunk == b"":  # closed by the server
                served = answer.startswith(b"HTTP/1.1 2")
                return (not served), f"{style}-slow socket was served: {answer[:80]!r}"
            answer += chunk
        return False, f"{style}-slow socket still open after {limit_s:.0f}s"
    except (ConnectionError, OSError):
        return True, ""  # reset by the server: closed, as it must be
    finally:
        writer.close()


async def slow_sockets(
    host: str, port: int, tally: AttackTally, until: float, parallel: int, limit_s: float
) -> None:
    styles = ["header", "body", "idle"]
    while time.monotonic() < until:
        results = await asyncio.gather(
            *(_slow_socket(host, port, styles[i % 3], limit_s) for i in range(parallel)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                tally.add("slow socket", False, f"{type(result).__name__}: {result}")
            else:
                tally.add("slow socket", *result)


# ---- huge headers, deep JSON, long prompts ----------------------------------------------


async def _huge_header(host: str, port: int, size: int) -> tuple[bool, str]:
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    try:
        writer.write(_head("/health") + b"X-Huge: ")
        piece = b"a" * 65536
        sent = 0
        while sent < size:
            writer.write(piece)
            sent += len(piece)
            try:
                await asyncio.wait_for(writer.drain(), timeout=5)
            except (ConnectionError, TimeoutError):
                break  # the server stopped reading or closed: what it must do
        answer = await asyncio.wait_for(reader.read(4096), timeout=5)
        elapsed = time.monotonic() - started
        if answer and not answer.startswith(b"HTTP/1.1 431"):
            return False, f"huge header answered {answer[:40]!r}"
        if elapsed > 5:
            return False, f"huge header took {elapsed:.1f}s to be refused"
        return True, ""
    except (ConnectionError, OSError, TimeoutError):
        return True, ""  # reset or closed mid-send: refused
    finally:
        writer.close()


async def _deep_json(http: httpx.AsyncClient) -> tuple[bool, str]:
    depth = 100_000
    nested = "[" * depth + "]" * depth
    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", '
        f'"extra": {nested}}}]}}'
    )
    response = await http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    return response.status_code == 400, f"deep JSON answered {response.status_code}"


async def _long_prompt(http: httpx.AsyncClient, rng: random.Random) -> tuple[bool, str]:
    words = " ".join(rng.choice(["harbour", "lamp", "tide", "storm", "gull"]) for _ in range(6000))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 4}
    response = await http.post("/v1/chat/completions", json=body)
    ok = response.status_code == 200 or (400 <= response.status_code < 500)
    return ok, f"long prompt answered {response.status_code}: {response.text[:120]}"


async def heavy_inputs(
    base_url: str, host: str, port: int, tally: AttackTally, until: float, seed: int
) -> None:
    """One of huge header, deep JSON or long prompt at a time, in turn."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        turn = 0
        while time.monotonic() < until:
            kind = ("huge header", "deep JSON", "long prompt")[turn % 3]
            turn += 1
            try:
                if kind == "huge header":
                    result = await _huge_header(host, port, 16 * 1024 * 1024)
                elif kind == "deep JSON":
                    result = await _deep_json(http)
                else:
                    result = await _long_prompt(http, rng)
            except httpx.HTTPError as exc:
                result = (False, f"{type(exc).__name__}: {exc}")
            tally.add(kind, *result)
            await asyncio.sleep(1.0)


# ---- pauses ---------------------------------------------------------------------------


async def pause_render(
    pid: int, probe: HealthProbe, tally: AttackTally, until: float, every_s: float, for_s: float
) -> None:
    """SIGSTOP the render process for `for_s` every `every_s` (the first after one period)."""
    while time.monotonic() + every_s + for_s < until:
        await asyncio.sleep(every_s)
        started = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(for_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        probe.pauses.append((started, time.monotonic()))
        tally.add("pause", True)
