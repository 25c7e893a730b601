"""--worker-dns on a real render server: the resolved set goes from [worker_a] to
[worker_a, worker_b] and back to [worker_b] while it serves, without a restart.

DNS is stood in for by `tests.e2e.resolver_stub` (the hidden --worker-dns-resolver hook):
the name is a file of addresses the test rewrites."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_admission import MODEL
from tests.helpers.processes import ServerProcess, WorkerProcess, start_render, stop_server
from tests.helpers.waiting import wait_until


def _samples(render: ServerProcess, family_name: str) -> dict[str, float]:
    """Value per `worker` label of one metric family."""
    text = httpx.get(f"{render.base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            return {
                sample.labels["worker"]: sample.value
                for sample in family.samples
                if not sample.name.endswith("_created")
            }
    return {}


def _alive(render: ServerProcess) -> set[str]:
    return {worker for worker, up in _samples(render, "duet_worker_alive").items() if up}


def _complete(render: ServerProcess, count: int) -> None:
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=render.base_url, timeout=120) as http:
        for _ in range(count):
            assert http.post("/v1/completions", json=body).status_code == 200


def test_workers_behind_a_name_join_and_leave(
    worker_a: WorkerProcess, worker_b: WorkerProcess, tmp_path: Path
) -> None:
    listing = tmp_path / "workers.txt"
    listing.write_text(f"{worker_a.address}\n")
    args = [
        "--worker-dns", f"{listing}:1",
        "--worker-dns-interval", "0.3",
        "--worker-dns-resolver", "tests.e2e.resolver_stub:resolve",
        "--routing", "round_robin",
    ]  # fmt: skip
    render = start_render([], tmp_path / "render.log", args)
    try:
        assert _alive(render) == {worker_a.address}

        listing.write_text(f"{worker_a.address}\n{worker_b.address}\n")
        wait_until(lambda: _alive(render) == {worker_a.address, worker_b.address}, 15, "b to join")
        _complete(render, 4)
        routed = _samples(render, "duet_render_requests_routed")
        assert routed == {worker_a.address: 2, worker_b.address: 2}  # round robin over both

        listing.write_text(f"{worker_b.address}\n")
        # A drained worker leaves the pool entirely, so it has no gauge at all any more.
        wait_until(
            lambda: set(_samples(render, "duet_worker_alive")) == {worker_b.address},
            15,
            "a to be drained and let go",
        )
        _complete(render, 2)
        routed = _samples(render, "duet_render_requests_routed")
        assert routed == {worker_a.address: 2, worker_b.address: 4}
    finally:
        stop_server(render)
