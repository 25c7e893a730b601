"""Soak: a steady mix of traffic for a long time, and nothing may leak or get lost.

Starts a gpu-worker and a render-serve on loopback, then keeps `--concurrency` clients
busy for `--duration` seconds with a mix of normal requests, streams, streams the client
drops after a few chunks, and bad requests; beside them, unless `--no-attackers`, the
attacker mix of bench/serving/soak_attacks.py (slow sockets, huge headers, deep JSON, long
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

    python -m bench.serving.soak                    # --duration 600
    python -m bench.serving.soak --duration 120     # a short one

and writes the `soak` section of bench/RESULTS.md (unless `--no-write`). Exit status 1
when a request was lost, the KV was not idle, or RSS or descriptors kept growing.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common.results_md import write_section
from bench.common.subprocesses import stop
from bench.serving.servers import WorkerProbe, is_idle, start_render, start_worker
from bench.serving.soak_report import AfterRun, report
from bench.serving.soak_traffic import SERVER_ERRORS, rss_mb, run_traffic


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
