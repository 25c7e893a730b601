"""The load generator of bench/serving/serve.py: one streamed request timed chunk by chunk,
open- and closed-loop load shapes, and the latency statistics vLLM's `bench serve` reports."""

from __future__ import annotations

import argparse
import asyncio
import math
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np
import psutil

from bench.serving.data import BenchRequest

METRICS = ("ttft", "tpot", "itl", "e2el")


def run_coroutine(coroutine):  # noqa: ANN001, ANN202 - any coroutine, its result
    """asyncio.run on uvloop when it is installed: the client then costs less CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


# ---- one streamed request ------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    """/inference/v1/generate's output: ids, no text."""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """The fields of an SSE chunk this client reads; the rest are skipped unparsed."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass
class RequestResult:
    """What one streamed request measured; times are `time.perf_counter()` seconds."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried generated text."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)


def request_body(model: str, request: BenchRequest) -> tuple[str, dict]:
    """The path and JSON body of one streamed request."""
    body: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.generate_token_ids is not None:
        sampling = {key: body.pop(key) for key in ("max_tokens", "ignore_eos", "temperature")}
        body.pop("model")
        return "/inference/v1/generate", body | {
            "token_ids": request.generate_token_ids,
            "sampling_params": sampling,
        }
    if request.is_chat:
        return "/v1/chat/completions", body | {"messages": request.messages}
    return "/v1/completions", body | {"prompt": request.prompt_token_ids}


async def stream_request(
    client: httpx.AsyncClient, model: str, request: BenchRequest
) -> RequestResult:
    """Send one streaming request and time every chunk of generated text."""
    path, body = request_body(model, request)
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            buffer = b""
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                *events, buffer = (buffer + raw).split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: ") and event != b"data: [DONE]":
                        _read_chunk(result, _decode_chunk(event[6:]), now)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
    if result.error is None and not result.chunk_times:
        result.error = "no generated text"
    return result


def _read_chunk(result: RequestResult, chunk: _Chunk, now: float) -> None:
    if chunk.error is not None:
        error = chunk.error
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
    if chunk.usage is not None:
        result.prompt_tokens = chunk.usage.prompt_tokens
        result.output_tokens = chunk.usage.completion_tokens
    for choice in chunk.choices:
        text = choice.text if choice.delta is None else choice.delta.content
        if text or choice.token_ids:
            result.chunk_times.append(now)
            return


@asynccontextmanager
async def client_pool(base_url: str, size: int) -> AsyncIterator[asyncio.Queue[httpx.AsyncClient]]:
    """`size` clients of one connection each, handed out through a queue: one shared
    pool of many connections costs httpcore time quadratic in its size, which made the
    load generator, not the server, the bottleneck at a few hundred streams."""
    ssl_context = ssl.create_default_context()  # built once; each client would build one
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [
        httpx.AsyncClient(
            base_url=base_url, limits=limits, timeout=httpx.Timeout(600.0), verify=ssl_context
        )
        for _ in range(size)
    ]
    queue: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    for client in clients:
        queue.put_nowait(client)
    try:
        yield queue
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


# ---- load shapes ---------------------------------------------------------------------


async def open_loop(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    *,
    burstiness: float = 1.0,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every request, arrivals Poisson at `request_rate` (gamma with `burstiness`
    shape; inf: all at once), at most `max_concurrency` in flight. Returns the results
    and the wall time from the first send to the last answer."""
    rng = np.random.default_rng(seed)
    async with client_pool(base_url, max_concurrency or len(requests)) as clients:

        async def one(request: BenchRequest) -> RequestResult:
            client = await clients.get()  # at most max_concurrency in flight
            try:
                return await stream_request(client, model, request)
            finally:
                clients.put_nowait(client)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if math.isfinite(request_rate):
                scale = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(rng.gamma(burstiness, scale))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


@dataclass
class Window:
    """The measured part of a closed-loop run, and the CPU each process used in it."""

    start: float
    end: float
    cpu_cores: dict[str, float] = field(default_factory=dict)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _sample_cpu(window: Window, processes: dict[str, psutil.Process]) -> None:
    await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    machine = busy_seconds()
    t0 = time.perf_counter()
    await asyncio.sleep(max(0.0, window.end - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    for name, process in processes.items():
        window.cpu_cores[name] = (cpu_seconds(process) - before[name]) / elapsed
    window.cpu_cores["whole machine"] = (busy_seconds() - machine) / elapsed


def busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (guest time is already in user)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


async def closed_loop(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    *,
    warmup_s: float,
    measure_s: float,
    processes: dict[str, psutil.Process],
) -> tuple[list[RequestResult], Window]:
    """`concurrency` users, each sending its next request as soon as the last one ends,
    until the window closes; requests in flight then finish unmeasured."""
    start = time.perf_counter()
    window = Window(start + warmup_s, start + warmup_s + measure_s)
    results: list[RequestResult] = []
    async with client_pool(base_url, concurrency) as clients:

        async def user(index: int) -> None:
            client = await clients.get()
            while time.perf_counter() < window.end:
                request = requests[index % len(requests)]
                index += concurrency
                results.append(await stream_request(client, model, request))

        sampler = asyncio.create_task(_sample_cpu(window, processes))
        await asyncio.gather(*(user(i) for i in range(concurrency)))
        await sampler
    return results, window


# ---- metrics -------------------------------------------------------------------------


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {f"{kind}_{name}_ms": float("nan") for kind in ("mean", "p50", "p99")}
    ms = np.asarray(values_s) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"p50_{name}_ms": float(np.percentile(ms, 50)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(
    results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]
) -> dict[str, float]:
    """vLLM's figures: throughputs, goodput, and mean/p50/p99 of each latency."""
    done = [r for r in results if r.error is None]
    values: dict[str, list[float]] = {name: [] for name in METRICS}
    good = 0
    for r in done:
        tpot = r.tpot
        mine = {"ttft": r.ttft, "e2el": r.end - r.start, "tpot": tpot}
        values["ttft"].append(mine["ttft"])
        values["e2el"].append(mine["e2el"])
        if tpot is not None:
            values["tpot"].append(tpot)
        values["itl"].extend(np.diff(r.chunk_times).tolist())
        good += all(
            mine[name] is None or mine[name] * 1000 <= limit for name, limit in slos_ms.items()
        )
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration_s,
    }
    if slos_ms:
        summary["goodput"] = good / duration_s
    for name in METRICS:
        summary |= _stats(name, values[name])
    return summary


def summarize_window(results: list[RequestResult], window: Window) -> dict[str, float]:
    """Throughput and ITL inside a closed-loop window. A request straddling an edge
    counts its tokens in proportion to its text chunks inside the window."""
    tokens = 0.0
    chunks = 0
    itls: list[float] = []
    ttfts: list[float] = []
    for r in results:
        if r.error is not None:
            continue
        inside = [t for t in r.chunk_times if window.start <= t < window.end]
        if inside:
            tokens += r.output_tokens * len(inside) / len(r.chunk_times)
            chunks += len(inside)
        gaps = np.diff(r.chunk_times)
        itls.extend(
            gap
            for gap, t in zip(gaps, r.chunk_times[1:], strict=True)
            if window.start <= t < window.end
        )
        if window.start <= r.chunk_times[0] < window.end:
            ttfts.append(r.ttft)
    seconds = window.end - window.start
    return {
        "failed": sum(r.error is not None for r in results),
        "output_throughput": tokens / seconds,
        "chunks_per_s": chunks / seconds,
        **_stats("itl", itls),
        **_stats("ttft", ttfts),
        **{f"cpu_cores_{name}": cores for name, cores in window.cpu_cores.items()},
    }


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:100 e2el:2000` (milliseconds) -> {"ttft": 500.0, ...}."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise argparse.ArgumentTypeError(f"bad --goodput item {item!r}: want ttft:MS")
        slos[name] = float(value)
    return slos
