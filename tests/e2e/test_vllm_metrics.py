"""render-serve's /metrics under vLLM's names, scraped from the session's real render
server and worker and read with prometheus_client's own parser: what vLLM's Grafana
dashboards and the Gateway API Inference Extension / llm-d scorers read."""

from __future__ import annotations

import time

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from render_server.generation.metrics import (
    VLLM_ITL_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
)
from tests.helpers.processes import DEFAULT_HEARTBEAT_INTERVAL_S, ServerProcess, WorkerProcess
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": VLLM_ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
}
WORKER_GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
]
WORKER_COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
BLOCK_SIZE = 16  # the session's workers run the default --block-size


def _scrape(render: ServerProcess) -> dict[str, tuple[str, list[Sample]]]:
    """Family name -> (type, samples)."""
    text = httpx.get(f"{render.base_url}/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    matches = [s.value for s in families[family][1] if s.name == sample and s.labels == labels]
    assert len(matches) == 1, f"{sample}{labels}: {matches}"
    return matches[0]


def test_render_exports_vllm_names_with_vllm_units_and_buckets(
    render: ServerProcess, client: OpenAI, worker_a: WorkerProcess
) -> None:
    before = _scrape(render)
    success_before = _value(
        before, "vllm:request_success", "vllm:request_success_total",
        model_name=MODEL, finished_reason="length",
    )  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]

    def recorded() -> dict | None:
        families = _scrape(render)
        success = _value(
            families, "vllm:request_success", "vllm:request_success_total",
            model_name=MODEL, finished_reason="length",
        )  # fmt: skip
        return families if success == success_before + 1 else None

    # Recorded when the request closes, which may trail the response by a moment.
    after = wait_until(recorded, 30, "the request in vllm:request_success_total")

    for name, buckets in HISTOGRAMS.items():
        kind, samples = after[name]
        assert kind == "histogram", name
        edges = [s.labels["le"] for s in samples if s.name == f"{name}_bucket"]
        assert edges == [*(str(float(b)) for b in buckets), "+Inf"], name
        assert all(s.labels["model_name"] == MODEL for s in samples), name
        # The same observations as duet's own histogram: recorded once.
        duet = name.replace("vllm:", "duet_render_").replace("request_queue", "queue")
        for suffix in ("_count", "_sum"):
            assert _value(after, name, name + suffix, model_name=MODEL) == _value(
                after, duet, duet + suffix
            ), name + suffix
    assert _value(after, "vllm:inter_token_latency_seconds",
                  "vllm:inter_token_latency_seconds_count", model_name=MODEL) >= 5  # fmt: skip

    for name, duet in [
        ("vllm:prompt_tokens", "duet_render_prompt_tokens"),
        ("vllm:generation_tokens", "duet_render_generation_tokens"),
    ]:
        assert after[name][0] == "counter"
        total = _value(after, name, f"{name}_total", model_name=MODEL)
        assert total == _value(after, duet, f"{duet}_total")
        grown = total - _value(before, name, f"{name}_total", model_name=MODEL)
        assert grown >= (usage.prompt_tokens if "prompt" in name else usage.completion_tokens)
    reasons = {s.labels["finished_reason"] for s in after["vllm:request_success"][1]}
    assert {"stop", "length", "abort"} <= reasons

    worker = {"model_name": MODEL, "worker": worker_a.address}
    for name in WORKER_GAUGES:
        assert after[name][0] == "gauge", name
        value = _value(after, name, name, **worker)
        assert value >= 0, name
    assert _value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", **worker) <= 1
    for name in WORKER_COUNTERS:
        assert after[name][0] == "counter", name

    def prefix_cache(families: dict) -> tuple[float, float]:
        """The worker's (queries, hits), in tokens."""
        queries, hits = (_value(families, n, f"{n}_total", **worker) for n in WORKER_COUNTERS)
        return queries, hits

    def settled() -> tuple[float, float] | None:
        """The counters once no heartbeat changes them: nothing admitted goes uncounted."""
        first = prefix_cache(_scrape(render))
        time.sleep(2.5 * DEFAULT_HEARTBEAT_INTERVAL_S)
        return first if prefix_cache(_scrape(render)) == first else None

    # The counters move with the worker's heartbeats. A prompt no other test sends, twice:
    # two lookups of its length, and the second hits every full block before its last
    # token (recomputed for its logits).
    queries, hits = wait_until(settled, 30, "the worker's prefix cache counters to settle")
    assert hits <= queries
    prompt = list(range(2000, 2036))
    replies = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1) for _ in range(2)
    ]
    length = replies[0].usage.prompt_tokens
    expected = (queries + 2 * length, hits + (length - 1) // BLOCK_SIZE * BLOCK_SIZE)
    assert expected[1] > hits

    def counted() -> tuple[float, float] | None:
        now = prefix_cache(_scrape(render))
        return now if now[0] >= expected[0] else None

    assert wait_until(counted, 30, "the worker's prefix cache lookups") == expected
