"""More fault tests with real processes, each bounded in time.

- a worker frozen with SIGSTOP mid-stream: noticed within 4 s, its streams finish on the
  other worker with the reference text; after SIGCONT it rejoins, with its KV idle;
- 100 clients dropping their streams at once: the workers' KV is idle within seconds;
- a "worker" that answers with garbage (a fake ROUTER, and a TCP peer that does not even
  speak ZMTP): the render server keeps serving through the real worker;
- KV exhaustion: 16 concurrent greedy requests on a ~40-block cache preempt each other
  and still produce exactly the tokens each produces alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from shared.model_card import ModelCard
from shared.protocol import (
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    Rejected,
    RequestDelta,
    Welcome,
    WorkerStats,
)
from shared.sampling import SamplingParams
from tests.e2e.test_faults import MODEL, chat_body, stream_chat, two_workers_one_render
from tests.e2e.test_openai_api import _Heartbeats
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    free_port,
    kill_worker,
    start_render,
    start_worker,
    stop_server,
)
from tests.helpers.waiting import WaitTimeout, wait_until
from tests.integration.test_worker_server import Client

PROMPTS = [
    "List the days of the week.",
    "Count from one to twenty in words.",
    "Name the planets of the solar system in order.",
]
DETECT_WITHIN_S = 4.0
IDLE_WITHIN_S = 5.0


def _reference(server: ServerProcess, prompt: str, max_tokens: int) -> str:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=chat_body(prompt, max_tokens, False),
        timeout=120,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def _worker_alive(server: ServerProcess, address: str) -> bool | None:
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    match = re.search(rf'duet_worker_alive{{worker="{re.escape(address)}"}} (\S+)', metrics)
    return None if match is None else float(match.group(1)) == 1.0


def _wait_idle(probes: list[_Heartbeats], within_s: float) -> list[WorkerStats]:
    """Each worker's stats once all are idle (no running or waiting, every block free)."""

    def all_idle() -> list[WorkerStats] | None:
        stats = [probe.latest(0.5).stats for probe in probes]
        if all(
            s.num_running == s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total
            for s in stats
        ):
            return stats
        return None

    return wait_until(all_idle, within_s, "KV to be idle", interval_s=0)


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[WorkerProcess, WorkerProcess, ServerProcess]]:
    """Two fresh workers (room for 100+ sequences each) behind one render server that
    declares a worker dead after 3 s of silence."""
    base = tmp_path_factory.mktemp("more-faults")
    with two_workers_one_render(base, 3, max_num_seqs=128, kv_cache_gb=0.5) as started:
        yield started


# ---- (a) SIGSTOP ---------------------------------------------------------------------


def test_sigstop_a_worker_mid_stream_streams_move_and_finish_identically(pair) -> None:
    first, second, render = pair
    max_tokens = 40
    reference = {prompt: _reference(render, prompt, max_tokens) for prompt in PROMPTS}
    probes = [_Heartbeats(first.address), _Heartbeats(second.address)]
    results: dict[str, dict] = {}
    started = [threading.Event() for _ in PROMPTS]
    threads = [
        threading.Thread(
            target=lambda i=i, p=p: results.update(
                {p: stream_chat(render, p, max_tokens, started[i])}
            )
        )
        for i, p in enumerate(PROMPTS)
    ]
    stopped: WorkerProcess | None = None
    try:
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60), "streams did not start"
        # A heartbeat sent just before the first step of the streams shows nothing running;
        # read fresh ones until one does (the streams last seconds).

        def some_running() -> list[int] | None:
            running = [probe.latest(1.0).stats.num_running for probe in probes]
            return running if max(running) >= 1 else None

        running = wait_until(some_running, 10, "a worker to show the streams", interval_s=0)
        victim = 0 if running[0] >= running[1] else 1
        assert running[victim] >= 1, running
        stopped = (first, second)[victim]
        os.kill(stopped.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_until(
            lambda: not _worker_alive(render, stopped.address),
            DETECT_WITHIN_S + 2,
            "the stopped worker to be marked dead",
        )
        detected_after = time.monotonic() - stopped_at
        for thread in threads:
            thread.join(120)
        assert detected_after < DETECT_WITHIN_S, f"marked dead only after {detected_after:.2f}s"
        moved = re.findall(r"marked dead; (\d+) of \d+ requests moved", render.log())
        assert moved, "no request moved off the stopped worker"
        assert int(moved[-1]) >= 1, "no request moved off the stopped worker"
        for prompt in PROMPTS:
            assert results[prompt]["errors"] == [], results[prompt]["errors"]
            assert results[prompt]["finish"] == "length"
            assert results[prompt]["text"] == reference[prompt], prompt

        # it comes back: heartbeats resume, the Aborts queued while it slept free its KV
        os.kill(stopped.process.pid, signal.SIGCONT)
        wait_until(
            lambda: _worker_alive(render, stopped.address),
            10,
            "the resumed worker to be taken back",
            interval_s=0.1,
        )
        _wait_idle(probes, 10)
    finally:
        if stopped is not None:
            os.kill(stopped.process.pid, signal.SIGCONT)  # harmless if already running
        for probe in probes:
            probe.close()


# ---- (b) 100 clients disconnect ------------------------------------------------------


def _has_content(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    event = json.loads(line[6:])
    return any(choice["delta"].get("content") for choice in event.get("choices", []))


async def _open_and_drop(
    base_url: str,
    count: int,
    max_tokens: int,
    all_started: asyncio.Event,
    release: asyncio.Event,
    started: list[int],
) -> None:
    """`count` streams; each waits for its first content, then for `release` (set once
    every stream has started and the workers were seen holding them), then closes its
    connection mid-stream."""
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:

        async def one(index: int) -> None:
            body = chat_body(f"Tell story number {index} about a lighthouse.", max_tokens, True)
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                # Held in a name: an abandoned line iterator is finalized at once, and
                # that would close the connection before every stream has started.
                lines = response.aiter_lines()
                async for line in lines:
                    if _has_content(line):
                        break
                started[0] += 1
                if started[0] == count:
                    all_started.set()
                await release.wait()
                del lines
            # leaving the block closes the connection with the stream unfinished

        await asyncio.gather(*(one(i) for i in range(count)))


def _held(probes: list[_Heartbeats], at_least: int, within_s: float) -> list[int]:
    """Requests each worker holds (running or preempted), from fresh heartbeats, polled
    until they add up to `at_least` or `within_s` passes. A heartbeat carries stats the
    engine published up to a second and a half earlier, so one read can predate the
    requests. Short of `at_least` at the deadline, the last reading: the caller judges it."""
    held: list[int] = []

    def all_held() -> bool:
        held[:] = [
            stats.num_running + stats.num_waiting
            for stats in (probe.latest(1.0).stats for probe in probes)
        ]
        return sum(held) >= at_least

    with contextlib.suppress(WaitTimeout):
        wait_until(all_held, within_s, f"{at_least} requests held", interval_s=0)
    return held


def test_100_clients_disconnect_mid_stream_kv_returns_to_idle(pair) -> None:
    first, second, render = pair
    count = 100
    probes = [_Heartbeats(first.address), _Heartbeats(second.address)]
    try:
        _wait_idle(probes, 30)
        all_started = asyncio.Event()
        release = asyncio.Event()
        started = [0]
        held_at_drop: list[int] = []

        async def scenario() -> None:
            task = asyncio.create_task(
                _open_and_drop(render.base_url, count, 512, all_started, release, started)
            )
            await asyncio.wait_for(all_started.wait(), 120)
            # everyone is mid-stream: see it on the workers before the clients leave
            held_at_drop.extend(await asyncio.to_thread(_held, probes, count, 10))
            release.set()
            await asyncio.wait_for(task, 60)

        asyncio.run(asyncio.wait_for(scenario(), 200))
        dropped_at = time.monotonic()
        assert started[0] == count
        assert sum(held_at_drop) >= count * 0.9, held_at_drop
        _wait_idle(probes, IDLE_WITHIN_S)
        assert time.monotonic() - dropped_at < IDLE_WITHIN_S + 1
    finally:
        for probe in probes:
            probe.close()
    assert render.process.poll() is None


# ---- (c) garbage from a worker connection --------------------------------------------


FOREIGN_CARD = ModelCard(
    model_id=MODEL,
    tokenizer_digest="f" * 64,
    vocab_size=49152,
    eos_token_ids=[2],
    max_model_len=8192,
)
_WORKER_SAMPLES = [
    Welcome(worker_id="impostor", model_card=FOREIGN_CARD),
    Deltas(deltas=[RequestDelta("no-such-request", [1, 2, 3], finish_reason="stop")], step=1),
    Heartbeat(sent_at=0.0, stats=WorkerStats(num_running=10**6, kv_blocks_total=1)),
    Rejected(request_id="no-such-request", code="protocol", message="who are you"),
]


def _garbage(rng: random.Random, samples: list[bytes]) -> list[bytes]:
    """One multipart message of junk: random bytes, mutated or misplaced valid frames."""
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:
        return [rng.choice(samples)]  # valid, but for nothing that exists
    if kind == 2:
        return [rng.randbytes(rng.randrange(1, 20)) for _ in range(rng.randrange(2, 5))]
    frame = bytearray(rng.choice(samples))
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(frame)) if frame else 0
        if kind == 3 and frame:
            frame[at] ^= 1 << rng.randrange(8)
        elif kind == 4:
            del frame[at:]
        else:
            frame[at:at] = rng.randbytes(rng.randrange(1, 8))
    return [bytes(frame)]


def _garbage_worker(seed: int) -> FakeWorker:
    """A fake worker that never welcomes and answers every peer with garbage, a few hundred
    messages a second."""
    rng = random.Random(seed)
    encoder = Encoder()
    samples = [encoder.encode(message) for message in _WORKER_SAMPLES]
    return FakeWorker(None, heartbeat_interval_s=None, noise=lambda: _garbage(rng, samples))


class _NoiseServer(threading.Thread):
    """A TCP listener that answers whoever connects with random bytes (not even ZMTP)."""

    def __init__(self, seed: int) -> None:
        super().__init__(daemon=True, name="noise-server")
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.rng = random.Random(seed)
        self.connections = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(0.2)
                try:
                    for _ in range(self.rng.randrange(1, 20)):
                        conn.sendall(self.rng.randbytes(self.rng.randrange(1, 2000)))
                except OSError:
                    pass
        self.listener.close()


def test_garbage_from_a_worker_connection_does_not_stop_serving(
    pair, tmp_path_factory: pytest.TempPathFactory
) -> None:
    first, _, _ = pair
    fake, noise = _garbage_worker(seed=7), _NoiseServer(seed=11)
    fake.start()
    noise.start()
    log = tmp_path_factory.mktemp("garbage") / "render.log"
    render = start_render([first.address, fake.endpoint, noise.address], log)
    try:
        reference = _reference(render, PROMPTS[0], 12)
        wait_until(
            lambda: fake.sent >= 2000 and noise.connections >= 1,
            30,
            "2000 garbage messages and a noise connection",
            interval_s=0.1,
            detail=lambda: (fake.sent, noise.connections),
        )
        for round_ in range(3):  # while the garbage keeps coming
            assert _reference(render, PROMPTS[0], 12) == reference
            started = threading.Event()
            streamed = stream_chat(render, PROMPTS[round_], 12, started)
            assert streamed["errors"] == []
            assert streamed["finish"] == "length"
            assert httpx.get(f"{render.base_url}/ready", timeout=5).status_code == 200
        assert _worker_alive(render, fake.endpoint) is False
        assert render.process.poll() is None
        assert "dropped a bad frame from worker" in render.log()
        assert "Traceback" not in render.log()
    finally:
        stop_server(render)
        fake.stop()
        noise.stopping.set()
        noise.join(5)


# ---- (d) KV exhaustion ---------------------------------------------------------------

BYTES_PER_BLOCK = 737_280  # SmolLM2-135M fp32: 30 layers x K,V x 3 heads x 64 x 16 tokens x 4
KV_BLOCKS = 40
NUM_REQUESTS = 16
OUTPUT_TOKENS = 40


def _prompt(index: int) -> list[int]:
    """13 tokens, distinct per index: the prompt fits one block, the output needs three."""
    return [1, 4093, 198] + [1000 + 97 * index + 7 * j for j in range(10)]


def _greedy(request_id: str, index: int) -> Generate:
    return Generate(
        request_id=request_id,
        prompt_token_ids=_prompt(index),
        sampling=SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True),
    )


@pytest.mark.slow  # 16 solo runs of 40 tokens first, then the 16 together
def test_kv_exhaustion_preempts_and_every_output_matches_its_solo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    gigabytes = (KV_BLOCKS * BYTES_PER_BLOCK + BYTES_PER_BLOCK // 2) / (1 << 30)
    log = tmp_path_factory.mktemp("kv-exhaustion") / "worker.log"
    worker = start_worker(log, kv_cache_gb=gigabytes)
    client = Client(worker.address)
    try:
        client.send(Hello(client_id="kv-exhaustion"))
        total = client.recv_until(Heartbeat).stats.kv_blocks_total
        assert KV_BLOCKS - 2 <= total <= KV_BLOCKS + 2, total
        solo = {}
        for index in range(NUM_REQUESTS):
            client.send(_greedy(f"solo-{index}", index))
            deltas = client.collect(f"solo-{index}", timeout_s=60)
            solo[index] = [token for delta in deltas for token in delta.new_token_ids]
            assert len(solo[index]) == OUTPUT_TOKENS

        for index in range(NUM_REQUESTS):
            client.send(_greedy(f"load-{index}", index))
        outputs: dict[str, list[int]] = {f"load-{i}": [] for i in range(NUM_REQUESTS)}
        finished: set[str] = set()
        all_running = preempted = False

        def all_finished() -> bool:
            nonlocal all_running, preempted
            message = client.poll(1.0)
            if isinstance(message, Deltas):
                for delta in message.deltas:
                    outputs[delta.request_id] += delta.new_token_ids
                    if delta.finish_reason is not None:
                        assert delta.finish_reason == "length", delta
                        finished.add(delta.request_id)
            elif isinstance(message, Heartbeat):
                stats = message.stats
                all_running |= stats.num_running == NUM_REQUESTS
                # Nothing new arrives after the burst, so a request waiting once all
                # of them ran is one that was preempted.
                preempted |= all_running and stats.num_waiting > 0
            elif isinstance(message, Rejected):
                raise AssertionError(f"rejected under load: {message}")
            return len(finished) == NUM_REQUESTS

        wait_until(
            all_finished,
            180,
            "every request to finish",
            interval_s=0,
            detail=lambda: f"only {len(finished)} finished",
        )
        assert all_running, (all_running, preempted)
        assert preempted, (all_running, preempted)
        for index in range(NUM_REQUESTS):
            assert outputs[f"load-{index}"] == solo[index], f"request {index} differs"
    finally:
        client.close()
        kill_worker(worker)
    assert "Traceback" not in log.read_text(errors="replace")
