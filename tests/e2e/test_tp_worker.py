"""`gpu-worker --tensor-parallel-size 2` behind render-serve (CPU, gloo): the same greedy
chat completion as a TP=1 worker, and a follower rank killed mid-stream takes the whole
worker down within seconds, non-zero, so the stream ends with `worker_lost` as for any
dead worker."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_faults import MAX_TOKENS, PROMPTS, chat_body, stream_chat
from tests.helpers.processes import (
    WorkerProcess,
    kill_worker,
    start_render,
    start_worker,
    stop_server,
)

TP2 = ["--tensor-parallel-size", "2", "--dist-timeout", "20"]


def _follower_pids(worker: WorkerProcess) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    pid = worker.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def _chat(base_url: str, prompt: str) -> str:
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=chat_body(prompt, 16, False), timeout=120
    )
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_worker_serves_tp1_tokens_and_dies_with_its_follower(tmp_path: Path) -> None:
    with contextlib.ExitStack() as cleanup:
        tp1 = start_worker(tmp_path / "tp1.log")
        cleanup.callback(kill_worker, tp1)
        tp2 = start_worker(tmp_path / "tp2.log", TP2, startup_s=180)
        cleanup.callback(kill_worker, tp2)
        render1 = start_render([tp1.address], tmp_path / "render1.log")
        cleanup.callback(stop_server, render1)
        render2 = start_render(
            [tp2.address], tmp_path / "render2.log", ["--heartbeat-timeout", "2"]
        )
        cleanup.callback(stop_server, render2)

        assert _chat(render2.base_url, PROMPTS[0]) == _chat(render1.base_url, PROMPTS[0])

        [follower] = _follower_pids(tp2)
        started = threading.Event()
        outcome: dict = {}
        thread = threading.Thread(
            target=lambda: outcome.update(stream_chat(render2, PROMPTS[1], MAX_TOKENS, started, 60))
        )
        thread.start()
        assert started.wait(60)
        killed_at = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        exit_code = tp2.process.wait(15)
        thread.join(15)
        assert not thread.is_alive(), "the stream hung"
        assert exit_code not in (0, None)
        assert time.monotonic() - killed_at < 15
        assert "tp-rank-1" in (tmp_path / "tp2.log").read_text()
        assert outcome["errors"]
        assert outcome["errors"][0]["code"] == "worker_lost"
