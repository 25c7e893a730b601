"""What a client does to a generating request is never a server error: leaving before a
non-streamed answer is ready is counted as 499 and logs nothing."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.helpers.processes import ServerProcess
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"


def answered(server: ServerProcess, status: int) -> float:
    """How many POST /v1/chat/completions the server answered with `status`."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=5.0).text
    pattern = (
        r"^duet_render_http_requests_total\{(?=[^}]*method=\"POST\")"
        rf"(?=[^}}]*route=\"/v1/chat/completions\")(?=[^}}]*status=\"{status}\")[^}}]*\}} (\S+)$"
    )
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


def test_a_client_that_leaves_before_its_answer_is_no_server_error(render: ServerProcess) -> None:
    log_start = len(render.log())
    left_before = answered(render, 499)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 256,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{render.base_url}/v1/chat/completions",
            json=body,
            timeout=httpx.Timeout(10.0, read=0.5),
        )
    wait_until(
        lambda: answered(render, 499) > left_before,
        10.0,
        "the abandoned request to be counted as 499",
        detail=lambda: render.log()[log_start:],
    )
    new_log = render.log()[log_start:]
    assert "Traceback" not in new_log, new_log
    assert answered(render, 500) == 0
