"""Cost of render + tokenize for a 3-turn chat: duet against transformers, same run.

(a) in-process: duet's ChatRenderer.render (template + tokenize) against
    transformers' `apply_chat_template(..., tokenize=True)` on the same tokenizer;
(b) over HTTP: POST /tokenize (chat form) to one real `render-serve` process at
    concurrency 1, 16 and 64, against transformers' in-process rate.

    python bench/render.py [--seconds 3] [--no-http]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from results_md import write_section

from render_server.chat_template import ChatRenderer
from render_server.tokenizer import Tokenizer
from shared.model_source import DEFAULT_MODEL, resolve_model

CHAT = [
    {
        "role": "system",
        "content": "You are a concise assistant that answers questions about cities.",
    },
    {"role": "user", "content": "What is the capital of France, and what is it known for?"},
    {
        "role": "assistant",
        "content": "Paris. It is known for the Eiffel Tower, the Louvre, cafés and fashion.",
    },
    {"role": "user", "content": "How many people live there? Give the city and the metro area."},
    {
        "role": "assistant",
        "content": "About 2.1 million in the city proper and roughly 12 million in the metro area.",
    },
    {"role": "user", "content": "Name three day trips from Paris by train, with travel times."},
]


@dataclass
class Timing:
    """Throughput and latency percentiles of one measured loop."""

    calls_per_s: float
    p50_ms: float
    p99_ms: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_calls(fn: Callable[[], object], seconds: float) -> Timing:
    for _ in range(20):
        fn()
    latencies: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return Timing(
        len(latencies) / elapsed,
        statistics.median(latencies) * 1e3,
        _percentile(latencies, 0.99) * 1e3,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _http_load(url: str, concurrency: int, seconds: float) -> Timing:
    body = {"messages": CHAT, "add_generation_prompt": True}
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        for _ in range(10):
            (await client.post("/tokenize", json=body)).raise_for_status()
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                response = await client.post("/tokenize", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return Timing(
        len(latencies) / elapsed,
        statistics.median(latencies) * 1e3,
        _percentile(latencies, 0.99) * 1e3,
    )


def run_http(concurrencies: list[int], seconds: float) -> dict[int, Timing]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "render_server.cli", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("render-serve did not start")
            time.sleep(0.1)
        return {c: asyncio.run(_http_load(url, c, seconds)) for c in concurrencies}
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per case")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP cases")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    source = resolve_model(DEFAULT_MODEL)
    tokenizer = Tokenizer.from_source(source)
    renderer = ChatRenderer(tokenizer)
    reference = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)

    ours_ids = renderer.render(CHAT, add_generation_prompt=True).token_ids
    ref_ids = reference.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else list(ref_ids)
    assert ours_ids == list(ref_ids), "duet and transformers disagree on the rendered ids"

    baseline = time_calls(
        lambda: reference.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True),
        args.seconds,
    )
    ours = time_calls(lambda: renderer.render(CHAT, add_generation_prompt=True), args.seconds)
    rows = [
        "| case | calls/s | p50 ms | p99 ms | ratio vs transformers in-process |",
        "|---|---:|---:|---:|---:|",
        f"| transformers apply_chat_template(tokenize=True) | {baseline.calls_per_s:,.0f} "
        f"| {baseline.p50_ms:.3f} | {baseline.p99_ms:.3f} | 1.00 |",
        f"| duet in-process ChatRenderer.render | {ours.calls_per_s:,.0f} | {ours.p50_ms:.3f} "
        f"| {ours.p99_ms:.3f} | {ours.calls_per_s / baseline.calls_per_s:.2f} |",
    ]
    if not args.no_http:
        for concurrency, timing in run_http([1, 16, 64], args.seconds).items():
            rows.append(
                f"| duet HTTP /tokenize, 1 process, concurrency {concurrency} "
                f"| {timing.calls_per_s:,.0f} | {timing.p50_ms:.3f} | {timing.p99_ms:.3f} "
                f"| {timing.calls_per_s / baseline.calls_per_s:.2f} |"
            )
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        body = (
            "## Render + tokenize (bench/render.py)\n\n"
            f"Command: `python bench/render.py --seconds {args.seconds:g}` on "
            f"{platform.processor() or platform.machine()}, {len(CHAT)}-message chat "
            f"({len(ours_ids)} tokens), SmolLM2 tokenizer. The HTTP load generator (httpx) "
            "runs on the same cores as the server.\n\n" + table
        )
        write_section("render", body)


if __name__ == "__main__":
    main()
