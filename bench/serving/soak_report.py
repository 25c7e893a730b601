"""The soak's report: what was lost, whether memory and descriptors kept growing, and how
the attackers and the /health probe fared; the `soak` section of RESULTS.md."""

from __future__ import annotations

import argparse
import os
import platform
from collections import Counter
from dataclasses import dataclass

from bench.common.results_md import command_line
from bench.serving.servers import is_idle
from bench.serving.soak_traffic import KINDS, SERVER_ERRORS, Attackers, Sample, Tally
from shared.protocol import WorkerStats


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
        "## Soak (bench/serving/soak.py)",
        "",
        f"Command: `{command_line(['--duration', f'{args.duration:g}'])}` (the documented run "
        f"is `{command_line([])}`, 600 s) on {platform.machine()}, {os.cpu_count()} CPUs; "
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
