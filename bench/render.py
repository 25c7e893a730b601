"""Cost of render + tokenize for a 3-turn chat: duet against transformers, same run.

(a) in-process: duet's ChatRenderer.render (template + tokenize) against
    transformers' `apply_chat_template(..., tokenize=True)` on the same tokenizer, for
    three kinds of input: the same chat every call (as a client resending a conversation),
    a new final user message every call (earlier turns repeat), and every message new;
(b) over HTTP: POST /tokenize (chat form) to one real `render-serve --render-only`
    process at concurrency 1, 16 and 64 (and 16 with a new final message per request),
    against transformers' in-process rate. The load generator is `wrk` when installed
    (`apt-get install wrk`), else an httpx client, which costs more CPU than the server.

    python -m bench.render [--seconds 3] [--no-http]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.common.machine import cpu_name
from bench.common.results_md import command_line, write_section
from bench.common.subprocesses import free_port, wait_http_ok
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.tokenizer import Tokenizer
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
# Placeholder for a per-request number in the HTTP body with a new final message.
_COUNTER = "@@N@@"


@dataclass
class Timing:
    """Throughput and latency percentiles of one measured loop."""

    calls_per_s: float
    p50_ms: float
    p99_ms: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timing(latencies: list[float], elapsed: float) -> Timing:
    return Timing(
        len(latencies) / elapsed,
        statistics.median(latencies) * 1e3,
        _percentile(latencies, 0.99) * 1e3,
    )


def time_calls(fns: list[Callable[[int], object]], seconds: float) -> list[Timing]:
    """Time each fn for `seconds` of calls fn(0), fn(1), ..., in alternating slices of
    0.1 s, so that a change in the machine's load (it is shared) hits all of them alike."""
    for fn in fns:
        for warm in range(-20, 0):
            fn(warm)
    latencies: list[list[float]] = [[] for _ in fns]
    busy = [0.0] * len(fns)
    counters = [itertools.count() for _ in fns]
    while min(busy) < seconds:
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                fn(next(counters[k]))
                t1 = time.perf_counter()
                latencies[k].append(t1 - t0)
                if t1 - start > 0.1:
                    break
            busy[k] += t1 - start
    return [_timing(timed, elapsed) for timed, elapsed in zip(latencies, busy, strict=True)]


def new_final_message(index: int) -> list[dict[str, str]]:
    """The chat with its last user message made unique."""
    return [*CHAT[:-1], {"role": "user", "content": f"{CHAT[-1]['content']} (#{index})"}]


def all_new(index: int) -> list[dict[str, str]]:
    """The chat with every message made unique: nothing repeats between calls."""
    return [{**message, "content": f"{message['content']} ({index})"} for message in CHAT]


INPUTS: dict[str, Callable[[int], list[dict[str, str]]]] = {
    "same chat every call": lambda index: CHAT,
    "new final user message every call": new_final_message,
    "every message new every call": all_new,
}


def _body(fresh_final_message: bool) -> str:
    chat = new_final_message(0) if fresh_final_message else CHAT
    if fresh_final_message:
        chat[-1]["content"] = chat[-1]["content"].replace("(#0)", f"(#{_COUNTER})")
    return json.dumps({"messages": chat, "add_generation_prompt": True})


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local head, tail = %s, %s
local counter = 0
if tail ~= nil then
  request = function()
    counter = counter + 1
    return wrk.format(nil, nil, nil, head .. counter .. tail)
  end
else
  wrk.body = head
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("DUET %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def _lua_string(text: str | None) -> str:
    if text is None:
        return "nil"
    assert "]==]" not in text
    return f"[==[{text}]==]"  # a long bracket: Lua reads it verbatim, no escapes


def _wrk_load(url: str, concurrency: int, seconds: float, body: str) -> Timing:
    head, counted, tail = body.partition(_COUNTER)
    script = _WRK_SCRIPT % (_lua_string(head), _lua_string(tail if counted else None))
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as file:
        file.write(script)
        file.flush()
        command = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "-s", file.name]
        output = subprocess.run(
            [*command, f"{url}/tokenize"], capture_output=True, text=True, check=True
        ).stdout
    line = next(line for line in output.splitlines() if line.startswith("DUET "))
    requests, duration_us, errors, p50_us, p99_us = map(int, line.split()[1:])
    if errors:
        raise RuntimeError(f"wrk saw {errors} failed requests:\n{output}")
    return Timing(requests / (duration_us / 1e6), p50_us / 1e3, p99_us / 1e3)


async def _httpx_load(url: str, concurrency: int, seconds: float, body: str) -> Timing:
    latencies: list[float] = []
    counter = itertools.count()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

        async def post() -> None:
            content = body.replace(_COUNTER, str(next(counter)))
            (await client.post("/tokenize", content=content, headers=headers)).raise_for_status()

        for _ in range(10):
            await post()
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                await post()
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return _timing(latencies, time.perf_counter() - start)


def run_http(cases: list[tuple[int, bool]], seconds: float) -> dict[tuple[int, bool], Timing]:
    """Timing per (concurrency, new final message per request) against one server."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "render_server.cli", "--port", str(port), "--render-only"]
        + ["--log-level", "warning"],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(f"{url}/health", server, timeout_s=120, poll_s=0.1):
            raise RuntimeError("render-serve did not start")
        headers = {"content-type": "application/json"}
        for _ in range(50):  # warm-up (compiled template, caches, connections)
            httpx.post(f"{url}/tokenize", content=_body(False), headers=headers).raise_for_status()
        results = {}
        for concurrency, fresh in cases:
            body = _body(fresh)
            if shutil.which("wrk"):
                results[concurrency, fresh] = _wrk_load(url, concurrency, seconds, body)
            else:
                results[concurrency, fresh] = asyncio.run(
                    _httpx_load(url, concurrency, seconds, body)
                )
        return results
    finally:
        server.terminate()
        server.wait(timeout=30)


def _row(case: str, timing: Timing, baseline: Timing) -> str:
    return (
        f"| {case} | {timing.calls_per_s:,.0f} | {timing.p50_ms:.3f} | {timing.p99_ms:.3f} "
        f"| {timing.calls_per_s / baseline.calls_per_s:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per case")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP cases")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    load = os.getloadavg()[0]

    source = resolve_model(DEFAULT_MODEL)
    tokenizer = Tokenizer.from_source(source)
    renderer = ChatRenderer(tokenizer)
    reference = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)

    def theirs(chat: list[dict[str, str]]) -> list[int]:
        ids: Any = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    for make in INPUTS.values():
        for index in (0, 1, 0):  # the second 0 comes from duet's caches
            chat = make(index)
            assert renderer.render(chat).token_ids == theirs(chat), "duet and transformers differ"
    ours_ids = renderer.render(CHAT).token_ids

    rows = [
        "| case | calls/s | p50 ms | p99 ms | ratio vs transformers in-process |",
        "|---|---:|---:|---:|---:|",
    ]
    baselines = {}
    for name, make in INPUTS.items():
        baseline, ours = time_calls(
            [
                lambda i, make=make: reference.apply_chat_template(
                    make(i), tokenize=True, add_generation_prompt=True
                ),
                lambda i, make=make: renderer.render(make(i)),
            ],
            args.seconds,
        )
        baselines[name] = baseline
        reference_case = f"transformers apply_chat_template(tokenize=True), {name}"
        rows.append(_row(reference_case, baseline, baseline))
        rows.append(_row(f"duet in-process ChatRenderer.render, {name}", ours, baseline))
    generator = "wrk" if shutil.which("wrk") else "httpx"
    if not args.no_http:
        cases = [(1, False), (16, False), (64, False), (16, True)]
        for (concurrency, fresh), timing in run_http(cases, args.seconds).items():
            inputs = "new final user message" if fresh else "same chat"
            baseline = baselines[
                "new final user message every call" if fresh else "same chat every call"
            ]
            rows.append(
                _row(
                    f"duet HTTP /tokenize, 1 process, {generator}, concurrency {concurrency}, "
                    f"{inputs}",
                    timing,
                    baseline,
                )
            )
    table = "\n".join(rows)
    print(table)
    if not args.no_write:
        body = (
            "## Render + tokenize (bench/render.py)\n\n"
            f"Command: `{command_line(['--seconds', f'{args.seconds:g}'])}` on "
            f"{cpu_name()}, {len(CHAT)}-message chat "
            f"({len(ours_ids)} tokens), SmolLM2 tokenizer, {os.cpu_count()} cores shared with "
            f"other work (load average {load:.1f} at the start). Each duet row is compared with "
            "the transformers row of the same inputs, timed in alternating 0.1 s slices; HTTP "
            "rows with transformers in-process on the same kind of input. "
            f"The HTTP load generator ({generator}, one thread) runs on the same cores as the "
            "server. duet reuses the token ids of text between special tokens seen before "
            "(exact; see `tokenizer._PieceCache`), so the first two kinds of input hit that "
            "cache for all or all but one turn; the third never does.\n\n" + table
        )
        write_section("render", body)


if __name__ == "__main__":
    main()
