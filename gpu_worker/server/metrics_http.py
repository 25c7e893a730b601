"""The worker's own Prometheus metrics over HTTP (`gpu-worker --metrics-port N`).

Under vLLM's names and labels (`model_name`, `engine="0"`), so a scraper, a vLLM Grafana
dashboard or an endpoint picker (the Gateway API Inference Extension reads
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`) reads a worker as it would a
vLLM pod. Latency histograms are measured where requests arrive, in render-serve's
/metrics; a worker reports its load and its counters.

The engine loop writes (a stats snapshot after every step, counts from the deltas); the
HTTP server's thread only reads: a reference swap and plain ints, so a scrape never
touches the engine nor waits for a step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.protocol import RequestDelta, WorkerStats

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

_LABELS = ["model_name", "engine"]
_FINISH_REASONS = ("stop", "length", "abort", "error")


class WorkerMetrics(Collector):
    """One worker's vLLM-named gauges and counters, kept by the engine loop, read at scrape
    time."""

    def __init__(self, model_name: str) -> None:
        self._labels = [model_name, "0"]
        self._stats = WorkerStats()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Every reason present from the start, as vLLM does: the scrape thread iterates
        # this dict while the engine loop increments it, which is safe while no key is added.
        self.finished = dict.fromkeys(_FINISH_REASONS, 0)

    def observe_stats(self, stats: WorkerStats) -> None:
        """The engine's load after a step (one reference swap: scrapes read whole snapshots)."""
        self._stats = stats

    def observe_deltas(self, deltas: Iterable[RequestDelta]) -> None:
        """Count one step's tokens and finished requests."""
        for delta in deltas:
            self.generation_tokens += len(delta.new_token_ids)
            if delta.queue_time is not None:
                # Only a request's first delta carries it: its prompt was just computed.
                self.prompt_tokens += delta.num_prompt_tokens
            if delta.finish_reason is not None:
                self.finished[delta.finish_reason] += 1

    def observe_aborts(self, count: int) -> None:
        """Requests aborted before finishing (their clients asked, or went away)."""
        self.finished["abort"] += count

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        labels = self._labels
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             kv_cache_usage(stats)),
            ("duet_lora_resident", "LoRA adapters in the worker's slots now.",
             len(stats.lora_resident)),
            ("duet_lora_registered", "LoRA adapters the worker can serve.",
             len(stats.lora_registered)),
        )  # fmt: skip
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=_LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             self.generation_tokens),
            ("duet_lora_loads", "LoRA adapters copied into a slot.", stats.lora_loads),
            ("duet_lora_evictions",
             "Resident LoRA adapters displaced (least recently used) by another.",
             stats.lora_evictions),
        )  # fmt: skip
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=_LABELS)
            counter.add_metric(labels, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason, count in list(self.finished.items()):
            success.add_metric([*labels, reason], count)
        yield success


def kv_cache_usage(stats: WorkerStats) -> float:
    """vLLM's `kv_cache_usage_perc`: the fraction (0..1) of KV blocks held by requests."""
    if not stats.kv_blocks_total:
        return 0.0
    return 1.0 - stats.kv_blocks_free / stats.kv_blocks_total


class MetricsServer:
    """http://HOST:PORT/metrics on a daemon thread of its own.

    Listening starts before the model loads (a taken port fails at once); the page is
    empty until `serve` hands it the worker's metrics.
    """

    def __init__(self, host: str, port: int) -> None:
        self._registry = registry = CollectorRegistry(auto_describe=False)
        server: WSGIServer
        thread: threading.Thread
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def serve(self, metrics: WorkerMetrics) -> None:
        self._registry.register(metrics)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
