"""Prometheus metrics of generation: latencies, token counts, finish reasons, and each
worker's load as its heartbeats report it (read at scrape time, never stale by more than
one heartbeat)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from render_server.generation.lifecycle import Generation
from render_server.worker_client.pool import WorkerStatus

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _WorkerCollector(Collector):
    """Per-worker gauges straight from the pool's latest heartbeats."""

    def __init__(self, statuses: Callable[[], list[WorkerStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker"]
        alive = GaugeMetricFamily("duet_worker_alive", "1 if the worker is alive.", labels=labels)
        running = GaugeMetricFamily(
            "duet_worker_num_requests_running", "Sequences running on the worker.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "duet_worker_num_requests_waiting", "Sequences queued on the worker.", labels=labels
        )
        kv_usage = GaugeMetricFamily(
            "duet_worker_kv_cache_usage", "Share of the worker's KV blocks in use.", labels=labels
        )
        for status in self._statuses():
            key = [status.address]
            alive.add_metric(key, 1.0 if status.alive else 0.0)
            stats = status.stats
            if stats is None:
                continue
            running.add_metric(key, stats.num_running)
            waiting.add_metric(key, stats.num_waiting)
            if stats.kv_blocks_total:
                kv_usage.add_metric(key, 1.0 - stats.kv_blocks_free / stats.kv_blocks_total)
        yield from (alive, running, waiting, kv_usage)


class MetricsHost(Protocol):
    """Where generation metrics live: the app's registry (render_server.http.metrics'
    RenderMetrics), and its live collectors, which are never summed across processes."""

    registry: CollectorRegistry

    def register_live(self, collector: Collector) -> None: ...


class GenerationMetrics:
    """Counters and histograms of chat/completions requests, on the app's registry."""

    def __init__(
        self,
        metrics: MetricsHost,
        worker_statuses: Callable[[], list[WorkerStatus]] | None = None,
    ) -> None:
        registry = metrics.registry
        self.ttft = Histogram(
            "duet_render_time_to_first_token_seconds",
            "From receiving the request to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "duet_render_inter_token_latency_seconds",
            "Time between two deltas of one choice.",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "duet_render_e2e_request_latency_seconds",
            "From receiving the request to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "duet_render_queue_time_seconds",
            "Time a request waited in a worker's queue before its first step.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "duet_render_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "duet_render_generation_tokens", "Tokens generated.", registry=registry
        )
        self.requests = Counter(
            "duet_render_requests_finished",
            "Choices finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.routed = Counter(
            "duet_render_requests_routed",
            "Choices sent to each worker.",
            ["worker"],
            registry=registry,
        )
        if worker_statuses is not None:
            # Live: each process reports its own view of the workers, never a sum.
            metrics.register_live(_WorkerCollector(worker_statuses))

    def record(self, generation: Generation) -> None:
        """Observe one request once it ended, whichever way it ended (its recorder)."""
        for prompt in generation.prompts:
            timings = prompt.timings
            if timings.first_token is not None:
                self.ttft.observe(timings.first_token - timings.arrival)
                self.e2e.observe((timings.last_token or time.perf_counter()) - timings.arrival)
            for gap in timings.inter_token:
                self.itl.observe(gap)
            if prompt.queue_time is not None:
                self.queue_time.observe(prompt.queue_time)
            self.prompt_tokens.inc(len(prompt.prompt_token_ids))
            self.generation_tokens.inc(prompt.num_completion_tokens)
        for choice in generation.choices:
            self.requests.labels(choice.finish_reason or "abort").inc()
        for address in generation.worker_addresses:
            self.routed.labels(address).inc()
