"""Routing: prefix-affinity vs round-robin on multi-turn conversations over two workers.

Many conversations share a few long system prompts; every turn re-sends the whole
growing history (as chat clients do), so a worker that served the previous turn holds
most of the next prompt in its prefix cache. Each mode gets two freshly started
gpu-workers (cold caches) and a fresh render-serve with `--routing MODE`, and the same
seeded workload; greedy decoding makes the histories identical across modes.

Measured per mode: prefix-cache hit rate two ways (cached prompt tokens from every
response's `usage.prompt_tokens_details.cached_tokens`, and the workers' own heartbeat
counters `prefix_cache_hits / prefix_cache_queries`), TTFT (first streamed content),
and how the requests spread over the workers.

    python -m bench.serving.routing               # 16 conversations x 4 turns, both modes
    python -m bench.serving.routing --conversations 8 --turns 3

writes the `routing` section of bench/RESULTS.md (unless `--no-write`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.results_md import command_line, write_section
from bench.common.subprocesses import stop
from bench.serving.servers import WorkerProbe, start_render, start_worker

MODEL = "SmolLM2-135M-Instruct"
MODES = ("round_robin", "prefix")
_VOCABULARY = (
    "the a service request cache worker token model answer question careful short clear "
    "policy account order invoice refund delivery support customer product warranty "
    "always never politely kindly include explain summarize list steps before after"
)
WORDS = _VOCABULARY.split()


@dataclass
class Conversation:
    """One user's chat: a shared system prompt and the user's turns, in order."""

    system: str
    user_turns: list[str]
    history: list[dict] = field(default_factory=list)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def build_workload(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant number {i} of the help desk. "
        + " ".join(_sentence(rng, 12) for _ in range(args.system_sentences))
        for i in range(args.system_prompts)
    ]
    return [
        Conversation(
            system=systems[index % len(systems)],
            user_turns=[_sentence(rng, rng.randint(12, 24)) for _ in range(args.turns)],
        )
        for index in range(args.conversations)
    ]


@dataclass
class TurnResult:
    """What one request of one turn measured."""

    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    reply: str


async def _turn(
    http: httpx.AsyncClient, messages: list[dict], max_tokens: int
) -> tuple[float, str, dict]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, pieces, usage = None, [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    pieces.append(content)
            usage = event.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("a stream ended without content or usage")
    return ttft, "".join(pieces), usage


async def run_conversations(
    base_url: str, workload: list[Conversation], args: argparse.Namespace
) -> list[TurnResult]:
    results: list[TurnResult] = []
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def converse(index: int, conversation: Conversation) -> None:
            async with gate:
                messages = [{"role": "system", "content": conversation.system}]
                for turn, text in enumerate(conversation.user_turns):
                    messages.append({"role": "user", "content": text})
                    ttft, reply, usage = await _turn(http, messages, args.max_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    results.append(
                        TurnResult(
                            index,
                            turn,
                            ttft,
                            usage["prompt_tokens"],
                            details.get("cached_tokens") or 0,
                            reply,
                        )
                    )
                    messages.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(workload)))
    return results


@dataclass
class ModeResult:
    """One routing mode's whole run."""

    mode: str
    turns: list[TurnResult]
    wall_s: float
    worker_queries: int
    worker_hits: int
    routed: list[int]

    @property
    def usage_hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0

    @property
    def worker_hit_rate(self) -> float:
        return self.worker_hits / self.worker_queries if self.worker_queries else 0.0

    def ttft(self, quantile: float, later_turns_only: bool = False) -> float:
        values = sorted(t.ttft_s for t in self.turns if t.turn > 0 or not later_turns_only)
        return values[min(len(values) - 1, int(quantile * len(values)))]

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(t.ttft_s for t in self.turns)


def _routed(base_url: str, addresses: list[str]) -> list[int]:
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    counts = []
    for address in addresses:
        pattern = rf'duet_render_requests_routed_total{{worker="{re.escape(address)}"}} (\S+)'
        match = re.search(pattern, metrics)
        counts.append(int(float(match.group(1))) if match else 0)
    return counts


def run_mode(mode: str, args: argparse.Namespace, logs: Path) -> ModeResult:
    """Fresh workers (cold caches) and a fresh render server, then the whole workload."""
    worker_args = ["--kv-cache-memory-gb", str(args.kv_cache_gb), *args.worker_arg]
    with ThreadPoolExecutor(2) as pool:  # both load the model at once
        workers = list(
            pool.map(
                lambda i: start_worker(
                    logs / f"{mode}-worker{i}.log", worker_args, args.worker_threads
                ),
                range(2),
            )
        )
    addresses = [address for _, address in workers]
    render = None
    try:
        render, base_url = start_render(logs / f"{mode}-render.log", addresses, ["--routing", mode])
        started = time.perf_counter()
        turns = asyncio.run(run_conversations(base_url, build_workload(args), args))
        wall_s = time.perf_counter() - started
        queries = hits = 0
        for address in addresses:
            probe = WorkerProbe(address)
            try:
                stats = probe.stats()
            finally:
                probe.close()
            queries += stats.prefix_cache_queries
            hits += stats.prefix_cache_hits
        return ModeResult(mode, turns, wall_s, queries, hits, _routed(base_url, addresses))
    finally:
        if render is not None:
            stop(render)
        for process, _ in workers:
            stop(process)


def markdown(results: dict[str, ModeResult], args: argparse.Namespace, same: bool) -> str:
    base, prefix = results["round_robin"], results["prefix"]
    requests = len(base.turns)
    lines = [
        "## Routing: prefix affinity vs round robin (bench/serving/routing.py)",
        "",
        f"Command: `{command_line(args.shown_args)}` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs; two CPU gpu-workers (SmolLM2-135M fp32, "
        f"{args.worker_threads} torch thread each, {args.kv_cache_gb:g} GiB KV, started fresh "
        f"for each mode) behind one render-serve. Workload: {args.conversations} conversations "
        f"x {args.turns} turns ({requests} requests), {args.system_prompts} shared system "
        f"prompts, each turn re-sending the whole history; greedy, {args.max_tokens} tokens per "
        f"reply, {args.concurrency} conversations at a time. Replies identical across modes: "
        f"{'yes' if same else 'NO'}.",
        "",
        "| routing | cached / prompt tokens (usage) | worker prefix hit rate | TTFT p50 ms | "
        "TTFT p90 ms | TTFT p50 ms, turns 2+ | mean TTFT ms | wall s | requests per worker |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in (base, prefix):
        lines.append(
            f"| {result.mode} | {result.usage_hit_rate:.1%} | {result.worker_hit_rate:.1%} | "
            f"{1000 * result.ttft(0.5):.0f} | {1000 * result.ttft(0.9):.0f} | "
            f"{1000 * result.ttft(0.5, later_turns_only=True):.0f} | "
            f"{1000 * result.mean_ttft:.0f} | {result.wall_s:.1f} | "
            f"{' / '.join(str(count) for count in result.routed)} |"
        )
    lines.append(
        f"| prefix / round_robin | {prefix.usage_hit_rate / max(base.usage_hit_rate, 1e-9):.2f}x "
        f"| {prefix.worker_hit_rate / max(base.worker_hit_rate, 1e-9):.2f}x | "
        f"{prefix.ttft(0.5) / base.ttft(0.5):.2f}x | {prefix.ttft(0.9) / base.ttft(0.9):.2f}x | "
        f"{prefix.ttft(0.5, True) / base.ttft(0.5, True):.2f}x | "
        f"{prefix.mean_ttft / base.mean_ttft:.2f}x | {prefix.wall_s / base.wall_s:.2f}x | |"
    )
    lines += [
        "",
        "The usage rate counts cached prompt tokens over all prompt tokens the responses "
        "report; the worker rate is the workers' own token counters (they also count lookups "
        "after a preemption). TTFT on CPU workers mixes the prefill a hit saves with queueing: "
        "prefix routing lets the worker holding a prefix run up to 4 more requests than the "
        "least-loaded one (the affinity margin), while round robin balances exactly.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-sentences", type=int, default=10, help="~15 tokens each")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25, help="per worker")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra worker flag")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()
    args.shown_args = [arg for arg in sys.argv[1:] if arg != "--no-write"]

    logs = Path(tempfile.mkdtemp(prefix="duet-routing-"))
    print(f"logs in {logs}", flush=True)
    results = {}
    for mode in MODES:
        results[mode] = run_mode(mode, args, logs)
        print(
            f"{mode}: usage hit rate {results[mode].usage_hit_rate:.1%}, worker hit rate "
            f"{results[mode].worker_hit_rate:.1%}, TTFT p50 {results[mode].ttft(0.5):.3f}s, "
            f"routed {results[mode].routed}, {results[mode].wall_s:.1f}s",
            flush=True,
        )
    replies = {
        mode: sorted((t.conversation, t.turn, t.reply) for t in result.turns)
        for mode, result in results.items()
    }
    body = markdown(results, args, replies["prefix"] == replies["round_robin"])
    print(body)
    if not args.no_write:
        write_section("routing", body)


if __name__ == "__main__":
    main()
