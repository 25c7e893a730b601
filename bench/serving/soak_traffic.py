"""The soak's traffic: a closed loop of normal requests, streams, streams the client drops
and bad requests, each judged (ok, dropped, a proper error, or lost / hung), beside the
attacker mix, while both processes' resources are sampled."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.serving.soak_attacks import (
    AttackTally,
    HealthProbe,
    heavy_inputs,
    pause_render,
    probe_health,
    slow_sockets,
)

MODEL = "SmolLM2-135M-Instruct"
ERROR_KEYS = {"message", "type", "param", "code"}

# ---- resources ------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    """Resources of both processes at one moment."""

    at_s: float
    worker_rss_mb: float
    worker_fds: int
    render_rss_mb: float
    render_fds: int
    requests: int


# ---- traffic --------------------------------------------------------------------------

TOPICS = ["the sea", "a lighthouse", "autumn", "a robot", "bread", "mountains", "a library"]
KINDS = {"normal": 3, "completion": 1, "stream": 3, "dropped": 2, "bad": 2}

BAD_REQUESTS: list[tuple[str, dict | bytes, dict[str, str]]] = [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', {}),  # invalid JSON
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, {}),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user"}]}, {}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi", "temperature": -1}, {}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {},
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 10**9},
        {},
    ),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, {}),  # token id out of vocab
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, {"content-type": "text/plain"}),
    ("/tokenize", {"prompt": 5}, {}),
    ("/detokenize", {"tokens": [-1]}, {}),
    ("/v1/no-such-route", {}, {}),
]


@dataclass
class Tally:
    """Outcome of every request, by kind."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome in ("lost", "hung"):
            self.lost.append(f"{kind} {outcome}: {detail}"[:300])

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())


def is_error_body(payload: object) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return (
        isinstance(error, dict)
        and not set(error) - ERROR_KEYS
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


SERVER_ERRORS: list[str] = []
"""X-Request-Id of every 5xx answer seen (the clients share one process)."""


def _judge_error(response: httpx.Response) -> tuple[str, str]:
    if response.status_code >= 500:
        SERVER_ERRORS.append(response.headers.get("x-request-id", "(none)"))
    if response.status_code >= 500 and response.status_code != 503:
        return "lost", f"{response.status_code}: {response.text[:200]}"
    try:
        payload = response.json()
    except ValueError:
        return "lost", f"{response.status_code} without a JSON error: {response.text[:200]}"
    if not is_error_body(payload):
        return "lost", f"{response.status_code} not in the OpenAI error shape: {payload}"
    return "error", ""


def _chat_body(rng: random.Random, stream: bool) -> dict:
    topic = rng.choice(TOPICS)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write two sentences about {topic}."}],
        "max_tokens": rng.randint(4, 32),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randint(0, 1000),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _normal(http: httpx.AsyncClient, rng: random.Random, path: str) -> tuple[str, str]:
    if path == "/v1/completions":
        prompt = f"Once upon a time, {rng.choice(TOPICS)}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(4, 32)}
    else:
        body = _chat_body(rng, stream=False)
    response = await http.post(path, json=body)
    if response.status_code != 200:
        return _judge_error(response)
    payload = response.json()
    choice = payload["choices"][0]
    if choice.get("finish_reason") not in ("stop", "length") or "usage" not in payload:
        return "lost", f"unfinished body: {payload}"
    return "ok", ""


async def _stream(http: httpx.AsyncClient, rng: random.Random, drop_after: int | None) -> tuple:
    """A streamed chat; with `drop_after`, the client hangs up after that many chunks."""
    chunks, finished, done = 0, False, False
    async with http.stream("POST", "/v1/chat/completions", json=_chat_body(rng, True)) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return _judge_error(reply)
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return ("error", "") if is_error_body(event) else ("lost", f"bad event {event}")
            chunks += 1
            finished |= any(choice.get("finish_reason") for choice in event.get("choices", []))
            if drop_after is not None and chunks >= drop_after:
                return "dropped", ""  # leaving the block closes the connection
    if not (done and finished):
        return "lost", f"stream ended without finish/[DONE] after {chunks} chunks"
    return "ok", ""


async def _bad(http: httpx.AsyncClient, rng: random.Random) -> tuple[str, str]:
    path, body, headers = rng.choice(BAD_REQUESTS)
    if isinstance(body, bytes):
        response = await http.post(path, content=body, headers={"content-type": "application/json"})
    elif headers:
        response = await http.post(path, content=json.dumps(body), headers=headers)
    else:
        response = await http.post(path, json=body)
    if response.status_code < 400:
        return "lost", f"{path} accepted a bad request: {response.status_code}"
    return _judge_error(response)


async def one_request(http: httpx.AsyncClient, rng: random.Random, kind: str) -> tuple[str, str]:
    if kind == "normal":
        return await _normal(http, rng, "/v1/chat/completions")
    if kind == "completion":
        return await _normal(http, rng, "/v1/completions")
    if kind == "stream":
        return await _stream(http, rng, None)
    if kind == "dropped":
        return await _stream(http, rng, rng.randint(1, 4))
    return await _bad(http, rng)


async def client_loop(
    base_url: str, seed: int, until: float, timeout_s: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http:
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome, detail = await one_request(http, rng, kind)
            except httpx.TimeoutException as exc:
                outcome, detail = "hung", f"{type(exc).__name__}: {exc}"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                outcome, detail = "lost", f"{type(exc).__name__}: {exc}"
            tally.add(kind, outcome, detail)


async def sampler(
    worker_pid: int, render_pid: int, every_s: float, until: float, tally: Tally
) -> list[Sample]:
    started = time.monotonic()
    samples: list[Sample] = []
    while True:
        now = time.monotonic()
        samples.append(
            Sample(
                round(now - started, 1),
                rss_mb(worker_pid),
                open_fds(worker_pid),
                rss_mb(render_pid),
                open_fds(render_pid),
                tally.total,
            )
        )
        if now >= until:
            return samples
        await asyncio.sleep(min(every_s, max(0.0, until - now)))


@dataclass
class Attackers:
    """What the attacker mix and the /health probe saw."""

    tally: AttackTally = field(default_factory=AttackTally)
    health: HealthProbe = field(default_factory=HealthProbe)


async def run_traffic(
    args: argparse.Namespace, base_url: str, pids: tuple[int, int]
) -> tuple[Tally, list[Sample], Attackers]:
    tally = Tally()
    attackers = Attackers()
    until = time.monotonic() + args.duration
    host, port = "127.0.0.1", int(base_url.rsplit(":", 1)[1])
    tasks = [
        client_loop(base_url, args.seed + index, until, args.request_timeout, tally)
        for index in range(args.concurrency)
    ]
    tasks.append(probe_health(base_url, attackers.health, until, every_s=0.2))
    if not args.no_attackers:
        # Slow sockets must be closed by the header / body / keep-alive timeouts (10, 30
        # and 5 s by default) plus the time their trickle takes to notice.
        tasks += [
            slow_sockets(host, port, attackers.tally, until, args.slow_sockets, limit_s=45),
            heavy_inputs(base_url, host, port, attackers.tally, until, args.seed),
            pause_render(
                pids[1], attackers.health, attackers.tally, until, args.pause_every, args.pause_for
            ),
        ]
    sampling = asyncio.create_task(sampler(*pids, args.sample_every, until, tally))
    await asyncio.gather(*tasks)
    return tally, await sampling, attackers
