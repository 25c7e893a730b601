"""Soak: a steady mix of traffic for a long time, and nothing may leak or get lost.

Starts a gpu-worker and a render-serve on loopback, then keeps `--concurrency` clients
busy for `--duration` seconds with a mix of normal requests, streams, streams the client
drops after a few chunks, and bad requests; beside them, unless `--no-attackers`, the
attacker mix of bench/soak_attacks.py (slow sockets, huge headers, deep JSON, long
prompts, the render process paused with SIGSTOP and continued). It reports:

- lost requests: every request must either complete (200 with a finished body or a
  stream that ends in `[DONE]`), be dropped by its own client, or get a proper error
  (4xx/429/503 in OpenAI's error shape, or an error event in the stream); a 5xx, a broken
  connection or a truncated stream is lost, a client timeout is hung;
- unlogged 5xx: every 5xx answer's X-Request-Id must be in the render server's log;
- /health latency (p50, p99, max) outside the pauses: the event loop never stalls;
- RSS and open file descriptors of both processes, sampled every `--sample-every` s, and
  the render RSS once the traffic stopped against its warm-up level;
- the worker's KV cache (from its heartbeats) once the traffic stops: it must be idle.

Not part of CI. The documented run is 10 minutes:

    python bench/soak.py                    # --duration 600
    python bench/soak.py --duration 120     # a short one

and writes the `soak` section of bench/RESULTS.md (unless `--no-write`). Exit status 1
when a request was lost, the KV was not idle, or RSS or descriptors kept growing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq
from results_md import write_section
from soak_attacks import (
    AttackTally,
    HealthProbe,
    heavy_inputs,
    pause_render,
    probe_health,
    slow_sockets,
)
from subprocesses import free_port, stop, wait_http_ok, wait_ready_line

from shared.protocol import Encoder, Heartbeat, Hello, WorkerMessageDecoder, WorkerStats
from shared.transport import make_dealer

REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
ERROR_KEYS = {"message", "type", "param", "code"}

# ---- processes ------------------------------------------------------------------------


def start_worker(log: Path, args: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    """A CPU gpu-worker on a free loopback port; returns it once it says it is ready."""
    address = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "gpu_worker.cli", "--bind", address, "--device", "cpu"]
    command += ["--log-level", "warning", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env, cwd=REPO
    )
    if wait_ready_line(process, "gpu-worker ready on", timeout_s=300):
        process.stdout.close()  # nothing else is read; never let a pipe fill
        return process, address
    stop(process)
    raise RuntimeError(f"gpu-worker did not start; see {log}")


def start_render(log: Path, workers: list[str], args: list[str]) -> tuple[subprocess.Popen, str]:
    """render-serve on a free port, connected to `workers`; returns it once /ready."""
    port = free_port()
    command = [sys.executable, "-m", "render_server.cli", "--port", str(port)]
    command += ["--log-level", "warning", *args]
    for address in workers:
        command += ["--worker", address]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DUET_")}
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO
    )
    base_url = f"http://127.0.0.1:{port}"
    if wait_http_ok(f"{base_url}/ready", process, timeout_s=180, poll_s=0.2):
        return process, base_url
    stop(process)
    raise RuntimeError(f"render-serve did not become ready; see {log}")


class WorkerProbe:
    """A bare wire client of one worker that reads its heartbeats."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = make_dealer(self.context, address, identity=uuid.uuid4().bytes)
        self.socket.send(Encoder().encode(Hello(client_id="bench-probe")))
        self.decoder = WorkerMessageDecoder()

    def stats(self, timeout_s: float = 5.0) -> WorkerStats:
        """The newest heartbeat's stats (drains the older ones)."""
        deadline = time.monotonic() + timeout_s
        latest = None
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                if latest is not None:
                    return latest
                continue
            message = self.decoder.decode(self.socket.recv())
            if isinstance(message, Heartbeat):
                latest = message.stats
        if latest is None:
            raise RuntimeError("no heartbeat from the worker")
        return latest

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def is_idle(stats: WorkerStats) -> bool:
    return (
        stats.num_running == stats.num_waiting == 0
        and stats.kv_blocks_free == stats.kv_blocks_total
    )


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


# ---- report ---------------------------------------------------------------------------


def growth(samples: list[Sample], attribute: str) -> float:
    """Last value minus the value after warm-up (the first fifth of the run)."""
    warm = samples[len(samples) // 5]
    return getattr(samples[-1], attribute) - getattr(warm, attribute)


@dataclass
class AfterRun:
    """What is checked once the traffic stopped."""

    idle: WorkerStats
    idle_after_s: float
    render_rss_mb: float
    """The render process's RSS a few seconds after the traffic stopped."""
    unlogged_5xx: list[str]
    """X-Request-Id of 5xx answers the render log does not name."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def attack_lines(args: argparse.Namespace, attackers: Attackers) -> tuple[list[str], bool]:
    """The attacker and /health part of the report, and whether it passed."""
    latencies = attackers.health.latencies_outside_pauses()
    p99 = percentile(latencies, 0.99)
    health_ok = p99 < args.max_health_p99_s
    lines = [
        "",
        f"/health every 0.2 s outside the {len(attackers.health.pauses)} pauses: "
        f"{len(latencies)} probes, p50 {1000 * percentile(latencies, 0.5):.1f} ms, "
        f"p99 {1000 * p99:.1f} ms, max {1000 * max(latencies, default=float('nan')):.1f} ms "
        f"(limit p99 {1000 * args.max_health_p99_s:.0f} ms).",
    ]
    if args.no_attackers:
        return lines, health_ok
    tally = attackers.tally
    kinds = sorted({kind for kind, _ in tally.outcomes})
    lines += [
        "",
        f"Attackers beside the traffic: {args.slow_sockets} slow sockets at a time (a third "
        "trickling headers, a third a body, a third idle), one of a 16 MB header / 100,000-deep "
        "JSON / 6,000-word prompt at a time, and the render process stopped (SIGSTOP) for "
        f"{args.pause_for:g} s every {args.pause_every:g} s (the worker drops a client silent "
        "2 s, so each pause makes the render server re-greet it and resume its streams).",
        "",
        "| attack | handled | not handled |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {tally.count(k, 'ok')} | {tally.count(k, 'lost')} |" for k in kinds]
    if tally.failures:
        lines += ["", "Attacks not handled (first 10):", ""]
        lines += [f"- {item}" for item in tally.failures[:10]]
    return lines, health_ok and not tally.failures


def report(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[Sample],
    after: AfterRun,
    attackers: Attackers,
) -> tuple[str, bool]:
    idle, idle_after_s = after.idle, after.idle_after_s
    by_outcome = Counter(outcome for (_, outcome) in tally.outcomes.elements())
    rss_growth = {name: growth(samples, f"{name}_rss_mb") for name in ("worker", "render")}
    fd_growth = {name: growth(samples, f"{name}_fds") for name in ("worker", "render")}
    warm_render = samples[len(samples) // 5].render_rss_mb
    rss_back = after.render_rss_mb - warm_render <= args.max_rss_growth_mb
    flat = all(value <= args.max_rss_growth_mb for value in rss_growth.values()) and all(
        value <= args.max_fd_growth for value in fd_growth.values()
    )
    attacks, attacks_passed = attack_lines(args, attackers)
    passed = (
        not tally.lost
        and is_idle(idle)
        and flat
        and rss_back
        and not after.unlogged_5xx
        and attacks_passed
    )
    lines = [
        "## Soak (bench/soak.py)",
        "",
        f"Command: `python bench/soak.py --duration {args.duration:g}` (the documented run is "
        f"`python bench/soak.py`, 600 s) on {platform.machine()}, {os.cpu_count()} CPUs; "
        f"CPU gpu-worker (SmolLM2-135M fp32, {args.worker_threads} torch thread) and one "
        f"render-serve; {args.concurrency} clients in a closed loop, request mix "
        + ", ".join(f"{kind} {weight}" for kind, weight in KINDS.items())
        + " (dropped = the client hangs up after 1-4 chunks; bad = 11 kinds of invalid "
        "request).",
        "",
        f"**{'PASS' if passed else 'FAIL'}**: {tally.total} requests, "
        f"{by_outcome['lost']} lost, {by_outcome['hung']} hung; {by_outcome['ok']} completed, "
        f"{by_outcome['dropped']} dropped by their client, {by_outcome['error']} answered with "
        f"a proper error; {len(SERVER_ERRORS)} 5xx answers, {len(after.unlogged_5xx)} of them "
        f"not in the render log. KV idle {idle_after_s:.1f} s after the traffic stopped "
        f"({idle.kv_blocks_free}/{idle.kv_blocks_total} blocks free, {idle.num_running} "
        "running).",
        "",
        "| kind | ok | dropped | error | lost | hung |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in KINDS:
        outcomes = ("ok", "dropped", "error", "lost", "hung")
        counts = [tally.outcomes[(kind, outcome)] for outcome in outcomes]
        lines.append(f"| {kind} | " + " | ".join(str(count) for count in counts) + " |")
    lines += [
        "",
        "Resources over time (RSS in MB, open file descriptors):",
        "",
        "| t (s) | requests | worker RSS | worker fds | render RSS | render fds |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    step = max(1, len(samples) // 10)
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    for s in shown:
        lines.append(
            f"| {s.at_s:.0f} | {s.requests} | {s.worker_rss_mb:.0f} | {s.worker_fds} | "
            f"{s.render_rss_mb:.0f} | {s.render_fds} |"
        )
    lines += [
        "",
        "Growth from the end of warm-up (first fifth) to the end: worker RSS "
        f"{rss_growth['worker']:+.1f} MB, render RSS {rss_growth['render']:+.1f} MB, worker fds "
        f"{fd_growth['worker']:+d}, render fds {fd_growth['render']:+d} (limits: "
        f"{args.max_rss_growth_mb:g} MB, {args.max_fd_growth} fds). Render RSS "
        f"{after.render_rss_mb:.0f} MB once the traffic stopped, against {warm_render:.0f} MB "
        f"after warm-up ({after.render_rss_mb - warm_render:+.1f} MB).",
        *attacks,
    ]
    if tally.lost:
        lines += ["", "Lost requests (first 10):", ""] + [f"- {item}" for item in tally.lost[:10]]
    return "\n".join(lines), passed


@contextmanager
def servers(
    args: argparse.Namespace,
    logs: Path,
) -> Iterator[tuple[subprocess.Popen, str, subprocess.Popen, str]]:
    print(f"logs in {logs}", flush=True)
    worker_args = ["--kv-cache-memory-gb", "0.25", "--max-num-seqs", "64"]
    if not args.no_attackers:
        worker_args += ["--client-timeout", "2"]  # a pause of the render server outlasts it
    worker, address = start_worker(
        logs / "worker.log", [*worker_args, *args.worker_arg], args.worker_threads
    )
    try:
        render, base_url = start_render(logs / "render.log", [address], [])
        try:
            yield worker, address, render, base_url
        finally:
            stop(render)
    finally:
        stop(worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8, help="clients in a closed loop")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="per request")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--max-fd-growth", type=int, default=8)
    parser.add_argument("--max-health-p99-s", type=float, default=0.1)
    parser.add_argument("--no-attackers", action="store_true", help="normal traffic only")
    parser.add_argument("--slow-sockets", type=int, default=12, help="open at a time")
    parser.add_argument("--pause-every", type=float, default=60.0, help="seconds between pauses")
    parser.add_argument("--pause-for", type=float, default=3.0, help="seconds each pause lasts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="duet-soak-"))
    with servers(args, logs) as (worker, address, render, base_url):
        pids = (worker.pid, render.pid)
        tally, samples, attackers = asyncio.run(run_traffic(args, base_url, pids))
        stopped = time.monotonic()
        probe = WorkerProbe(address)
        try:
            idle = probe.stats()
            while not is_idle(idle) and time.monotonic() - stopped < 30:
                idle = probe.stats()
        finally:
            probe.close()
        idle_after_s = time.monotonic() - stopped
        time.sleep(max(0.0, 5.0 - idle_after_s))  # let the last buffers go before measuring
        render_rss = rss_mb(render.pid)
        alive = worker.poll() is None and render.poll() is None
    render_log = (logs / "render.log").read_text(errors="replace")
    unlogged = [request_id for request_id in SERVER_ERRORS if request_id not in render_log]
    after = AfterRun(idle, idle_after_s, render_rss, unlogged)
    body, passed = report(args, tally, samples, after, attackers)
    passed &= alive
    print(body)
    if not args.no_write:
        write_section("soak", body)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
