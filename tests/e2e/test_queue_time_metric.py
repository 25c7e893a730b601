"""The worker's queue time reaches the render tier's metric: the worker sets
`RequestDelta.queue_time` on a request's first delta, and `duet_render_queue_time_seconds`
observes it once per request."""

from __future__ import annotations

import re

import httpx
from openai import OpenAI

from tests.helpers.processes import ServerProcess
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"


def _queue_time_count(render: ServerProcess) -> float:
    metrics = httpx.get(f"{render.base_url}/metrics", timeout=30).text
    match = re.search(r"^duet_render_queue_time_seconds_count (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_queue_time_is_recorded_for_a_chat_request(render: ServerProcess, client: OpenAI) -> None:
    before = _queue_time_count(render)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    # Recorded when the request ends, which may trail the response by a moment.
    wait_until(lambda: _queue_time_count(render) > before, 30, "a queue time observation")
