"""`render-serve --processes 2`: two render processes on one port, each connected to the
worker. Both serve, /metrics in either sums the two, and SIGTERM drains both, exit 0.

Which process answered is read from the access log, whose lines carry the process id."""

from __future__ import annotations

import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_admission import MODEL, _body, _stream_in_background, assert_sigterm_drains
from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    spawn_server,
    start_render,
    stop_server,
)
from tests.helpers.waiting import wait_until

_ACCESS = re.compile(r'\[(\d+)\] uvicorn\.access: \S+ - "(\w+) (\S+) HTTP/1\.1" 200')


def _answered_by(render: ServerProcess, method: str, path: str) -> Counter[str]:
    """Requests answered with 200, per render process id."""
    return Counter(
        pid
        for pid, seen_method, seen_path in _ACCESS.findall(render.log())
        if (seen_method, seen_path) == (method, path)
    )


def _start_two_draining(worker: WorkerProcess, tmp_path: Path) -> ServerProcess:
    """Two render processes with a long drain, both started: /ready answers once one
    serves, and a drain is about both (SIGTERM mid-startup is another case)."""
    render = start_render(
        [worker.address], tmp_path / "render.log", ["--processes", "2", "--drain-timeout", "60"]
    )
    try:
        wait_until(
            lambda: render.log().count("Application startup complete") >= 2,
            60,
            "the second render process to start",
        )
    except BaseException:
        stop_server(render)
        raise
    return render


def _complete(base_url: str) -> int:
    # A connection per request, so the kernel may hand each to either process.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).status_code


def _completions_counted(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "duet_render_http_requests":
            for sample in family.samples:
                labels = sample.labels
                if (
                    sample.name.endswith("_total")
                    and labels["route"] == "/v1/completions"
                    and labels["status"] == "200"
                ):
                    return sample.value
    return 0.0


def test_both_processes_serve_and_metrics_sum_them(worker_a: WorkerProcess, tmp_path) -> None:
    render = start_render(
        [worker_a.address], tmp_path / "render.log", ["--processes", "2", "--access-log"]
    )
    try:
        sent = 0
        with ThreadPoolExecutor(6) as threads:

            def both_answered() -> bool:
                nonlocal sent
                assert list(threads.map(_complete, [render.base_url] * 6)) == [200] * 6
                sent += 6
                return sent >= 24 and len(_answered_by(render, "POST", "/v1/completions")) >= 2

            # Until both processes have answered (the second may still be loading at first).
            wait_until(
                both_answered, 180, "both processes to answer", interval_s=0, detail=render.log
            )
        wait_until(
            lambda: sum(_answered_by(render, "POST", "/v1/completions").values()) == sent,
            10,
            "every access log line",
        )
        # A request is counted just after its last byte left: wait for the last ones once,
        # then every scrape, whichever process answers it, must say exactly `sent`.
        wait_until(lambda: _completions_counted(render.base_url) == sent, 10, "the counters")
        for _ in range(40):
            assert _completions_counted(render.base_url) == sent
            if len(_answered_by(render, "GET", "/metrics")) == 2:
                break
        assert len(_answered_by(render, "GET", "/metrics")) == 2, "one process took every scrape"
        # The per-worker gauges are the answering process's own view, not a sum of two.
        scrape = httpx.get(f"{render.base_url}/metrics", timeout=30).text
        assert f'duet_worker_alive{{worker="{worker_a.address}"}} 1.0' in scrape
    finally:
        stop_server(render)
    assert render.process.returncode == 0


def test_sigterm_drains_every_process_then_exits_0(worker_a: WorkerProcess, tmp_path) -> None:
    render = _start_two_draining(worker_a, tmp_path)
    try:
        assert_sigterm_drains(render, 40)
    finally:
        stop_server(render)


def test_requests_during_a_multi_process_drain_are_refused_never_cut(
    worker_a: WorkerProcess, tmp_path
) -> None:
    """While one process drains a stream and the other, idle, exits at once: every request
    sent meanwhile is answered, with the 503 "draining" once the signal has reached the
    process that takes it, and never by a connection closed without an answer (the idle one
    used to close connections it had just accepted)."""
    render = _start_two_draining(worker_a, tmp_path)
    try:
        thread, out = _stream_in_background(render.base_url, 400)
        render.process.send_signal(signal.SIGTERM)
        outcomes: Counter[str] = Counter()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                reply = httpx.post(
                    f"{render.base_url}/v1/chat/completions", json=_body(4, False), timeout=30
                )
            except httpx.TransportError as exc:
                outcomes[type(exc).__name__] += 1
                continue
            # A request that reached a process before the forwarded signal is served.
            error = reply.json().get("error", {}).get("code") if reply.status_code != 200 else ""
            outcomes[f"{reply.status_code} {error}".strip()] += 1
        # Every request went out while the stream still drained: a refused connection
        # would have been a bug, not the end of the server.
        assert thread.is_alive(), "the stream ended before the requests did"
        thread.join(120)
        assert outcomes["503 draining"] > 0, outcomes
        assert set(outcomes) <= {"200", "503 draining"}, outcomes
        assert out["finish"] == "length", out
        assert render.process.wait(30) == 0
    finally:
        stop_server(render)


def test_sigterm_while_the_processes_are_starting_exits_0(
    worker_a: WorkerProcess, tmp_path
) -> None:
    """A stop that reaches the render processes before they serve (a deploy rolled back at
    once) is still a clean stop: exit 0, no traceback."""
    render = spawn_server(["--processes", "2", "--worker", worker_a.address], tmp_path / "r.log")
    try:

        def both_started() -> bool:
            assert render.process.poll() is None, render.log()
            return render.log().count("started render process") >= 2

        wait_until(both_started, 60, "the render processes to be started", interval_s=0.02)
        render.process.send_signal(signal.SIGTERM)
        assert render.process.wait(30) == 0, render.log()
    finally:
        if render.process.poll() is None:
            render.process.kill()
            render.process.wait()
    text = render.log()
    assert "Traceback" not in text, text
    # Loading the tokenizer takes seconds: the stop came while at least one was starting.
    assert text.count("Application startup complete") < 2, text
