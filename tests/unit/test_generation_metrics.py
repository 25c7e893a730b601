"""Generation metrics under duet's names and vLLM's: recorded once, exported twice, each
histogram with its own bucket edges and the same counts a histogram with only those edges
would have."""

from __future__ import annotations

import types

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from render_server.generation.metrics import (
    VLLM_ITL_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    GenerationMetrics,
)
from render_server.http.metrics import RenderMetrics
from shared.protocol import WorkerStats

GAPS = [0.0005, 0.004, 0.01, 0.012, 0.03, 0.2, 0.75, 3.0, 90.0]
TTFT, E2E, QUEUE = 0.07, 1.2, 0.4


def _generation(finish_reason: str | None) -> types.SimpleNamespace:
    """What `GenerationMetrics.record` reads of a `Generation`."""
    timings = types.SimpleNamespace(
        arrival=10.0, first_token=10.0 + TTFT, last_token=10.0 + E2E, inter_token=GAPS
    )
    prompt = types.SimpleNamespace(
        timings=timings, queue_time=QUEUE, prompt_token_ids=[1] * 30, num_completion_tokens=10
    )
    choice = types.SimpleNamespace(finish_reason=finish_reason)
    return types.SimpleNamespace(prompts=[prompt], choices=[choice], worker_addresses=["w"])


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _reference(buckets: tuple[float, ...], values: list[float]) -> dict[str, float]:
    """Bucket counts of a plain histogram with exactly `buckets`."""
    registry = CollectorRegistry()
    histogram = Histogram("ref", "", buckets=buckets, registry=registry)
    for value in values:
        histogram.observe(value)
    samples = _samples(generate_latest(registry).decode())
    return {dict(labels)["le"]: v for (name, labels), v in samples.items() if name == "ref_bucket"}


def _buckets(samples: dict, name: str) -> dict[str, float]:
    return {
        dict(labels)["le"]: value
        for (sample, labels), value in samples.items()
        if sample == f"{name}_bucket"
    }


def test_histograms_under_both_names_have_their_own_edges_and_exact_counts() -> None:
    host = RenderMetrics()
    stats = WorkerStats(
        num_running=3, num_waiting=2, kv_blocks_free=30, kv_blocks_total=40,
        prefix_cache_queries=500, prefix_cache_hits=128,
        spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
    )  # fmt: skip
    status = types.SimpleNamespace(address="tcp://w:1", alive=True, stats=stats)
    metrics = GenerationMetrics(host, lambda: [status], model_name="smol")  # type: ignore[list-item]
    for reason in ("length", "stop", None):
        metrics.record(_generation(reason))  # type: ignore[arg-type]
    samples = _samples(host.exposition().decode())

    duet_latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
    duet_itl = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
    cases = [
        ("duet_render_time_to_first_token_seconds", duet_latency, [TTFT] * 3),
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS, [TTFT] * 3),
        ("duet_render_inter_token_latency_seconds", duet_itl, GAPS * 3),
        ("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS, GAPS * 3),
        ("duet_render_e2e_request_latency_seconds", duet_latency, [E2E] * 3),
        ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS, [E2E] * 3),
        ("duet_render_queue_time_seconds", duet_latency, [QUEUE] * 3),
        ("vllm:request_queue_time_seconds", VLLM_REQUEST_LATENCY_BUCKETS, [QUEUE] * 3),
    ]
    for name, buckets, values in cases:
        assert _buckets(samples, name) == _reference(buckets, values), name
        labels = (("model_name", "smol"),) if name.startswith("vllm:") else ()
        assert samples[(f"{name}_count", labels)] == len(values), name
        assert abs(samples[(f"{name}_sum", labels)] - sum(values)) < 1e-9, name

    model = (("model_name", "smol"),)
    assert samples[("vllm:prompt_tokens_total", model)] == 90
    assert samples[("vllm:generation_tokens_total", model)] == 30
    assert samples[("duet_render_prompt_tokens_total", ())] == 90
    success = {
        dict(labels)["finished_reason"]: value
        for (name, labels), value in samples.items()
        if name == "vllm:request_success_total"
    }
    assert success == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    assert samples[("duet_render_requests_finished_total", (("finish_reason", "abort"),))] == 1

    worker = (("model_name", "smol"), ("worker", "tcp://w:1"))
    assert samples[("vllm:num_requests_running", worker)] == 3
    assert samples[("vllm:num_requests_waiting", worker)] == 2
    assert samples[("vllm:kv_cache_usage_perc", worker)] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", worker)] == 500
    assert samples[("vllm:prefix_cache_hits_total", worker)] == 128
    assert samples[("vllm:spec_decode_num_draft_tokens_total", worker)] == 40
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", worker)] == 25
    assert samples[("duet_worker_num_requests_running", (("worker", "tcp://w:1"),))] == 3
