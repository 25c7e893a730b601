"""Prometheus metrics of generation: latencies, token counts, finish reasons, and each
worker's load as its heartbeats report it (read at scrape time, never stale by more than
one heartbeat).

Every figure is exported twice: under duet's names (`duet_render_*`, `duet_worker_*`) and
under vLLM's (`vllm:*`, with vLLM's units, bucket edges and `model_name` label), so vLLM's
Grafana dashboards and the Gateway API Inference Extension / llm-d scorers read a duet
deployment as they read vLLM. A request is still recorded once: each latency histogram
records with the union of both sets of edges, and at scrape time a view shows it as two
histograms, each with its own edges (a cumulative bucket count does not depend on the
edges around it, so both are exact); the counters are renamed the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from render_server.generation.lifecycle import Generation
from render_server.worker_client.pool import WorkerStatus

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# vLLM's edges (vllm/v1/metrics/loggers.py), so quantiles on its dashboards read the same.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error")


class MetricsHost(Protocol):
    """Where generation metrics live: the app's registry (render_server.http.metrics'
    RenderMetrics), its live collectors (never summed across processes) and its views."""

    registry: CollectorRegistry

    def register_live(self, collector: Collector) -> None: ...
    def add_view(self, name: str, view: Callable[[Metric], Iterable[Metric]]) -> None: ...


def _subset(
    family: Metric, name: str, documentation: str, labels: dict[str, str], edges: Iterable[float]
) -> Metric:
    """`family` renamed, with `labels` added and, for a histogram, only the buckets of
    `edges` (which the recorded edges must include) and +Inf."""
    kept = {*edges, math.inf}
    out = Metric(name, documentation, family.type)
    for sample in family.samples:
        if sample.name.endswith("_bucket") and float(sample.labels["le"]) not in kept:
            continue
        suffix = sample.name[len(family.name) :]
        out.samples.append(sample._replace(name=name + suffix, labels={**labels, **sample.labels}))
    return out


class _Family:
    """One figure recorded once, exported under duet's name and vLLM's."""

    def __init__(self, name: str, documentation: str, vllm_name: str, vllm_documentation: str):
        self.name, self.documentation = name, documentation
        self.vllm_name, self.vllm_documentation = vllm_name, vllm_documentation

    def histogram(
        self, host: MetricsHost, model_name: str, edges: tuple[float, ...], vllm: tuple[float, ...]
    ) -> Histogram:
        def view(family: Metric) -> Iterator[Metric]:
            yield _subset(family, self.name, self.documentation, {}, edges)
            yield _subset(family, self.vllm_name, self.vllm_documentation, labels, vllm)

        labels = {"model_name": model_name}
        host.add_view(self.name, view)
        union = tuple(sorted({*edges, *vllm}))
        return Histogram(self.name, self.documentation, buckets=union, registry=host.registry)

    def counter(self, host: MetricsHost, model_name: str) -> Counter:
        def view(family: Metric) -> Iterator[Metric]:
            yield family
            yield _subset(family, self.vllm_name, self.vllm_documentation, labels, ())

        labels = {"model_name": model_name}
        host.add_view(self.name, view)
        return Counter(self.name, self.documentation, registry=host.registry)


def _request_success_view(model_name: str) -> Callable[[Metric], Iterator[Metric]]:
    """duet's finish-reason counter, and vLLM's `request_success` made of it: every
    reason present from the start (as vLLM does), `finished_reason` as vLLM spells it."""

    def view(family: Metric) -> Iterator[Metric]:
        yield family
        counts = dict.fromkeys(VLLM_FINISHED_REASONS, 0.0)
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["finish_reason"]] = sample.value
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in counts.items():
            success.add_metric([model_name, reason], count)
        yield success

    return view


class _WorkerCollector(Collector):
    """Per-worker gauges and counters straight from the pool's latest heartbeats."""

    def __init__(self, statuses: Callable[[], list[WorkerStatus]], model_name: str) -> None:
        self._statuses = statuses
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
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
        # vLLM's names for the same figures, per worker: `worker` is its address (vLLM's
        # `engine` is an index within one server, which a duet worker has no use for).
        vllm_labels = ["model_name", "worker"]
        vllm_running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=vllm_labels,
        )
        vllm_waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=vllm_labels,
        )
        vllm_kv_usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels=vllm_labels,
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=vllm_labels,
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels=vllm_labels,
        )
        # vLLM's adapter info gauge (its value the time of the figures): the adapters of
        # our requests on the worker, running where resident in a slot, else waiting for
        # one, and the worker's slot count. Only for workers that serve adapters.
        lora_info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "worker"],
        )
        lora_resident = GaugeMetricFamily(
            "duet_worker_lora_resident", "LoRA adapters in the worker's slots.", labels=labels
        )
        lora_registered = GaugeMetricFamily(
            "duet_worker_lora_registered", "LoRA adapters the worker can serve.", labels=labels
        )
        lora_loads = CounterMetricFamily(
            "duet_worker_lora_loads", "LoRA adapters filled into a slot.", labels=labels
        )
        lora_evictions = CounterMetricFamily(
            "duet_worker_lora_evictions",
            "LoRA adapters evicted from a slot to make room for another.",
            labels=labels,
        )
        for status in self._statuses():
            key = [status.address]
            alive.add_metric(key, 1.0 if status.alive else 0.0)
            stats = status.stats
            if stats is None:
                continue
            vllm_key = [self._model_name, status.address]
            usage = (
                1.0 - stats.kv_blocks_free / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
            )
            running.add_metric(key, stats.num_running)
            vllm_running.add_metric(vllm_key, stats.num_running)
            waiting.add_metric(key, stats.num_waiting)
            vllm_waiting.add_metric(vllm_key, stats.num_waiting)
            if stats.kv_blocks_total:
                kv_usage.add_metric(key, usage)
            vllm_kv_usage.add_metric(vllm_key, usage)
            queries.add_metric(vllm_key, stats.prefix_cache_queries)
            hits.add_metric(vllm_key, stats.prefix_cache_hits)
            if not stats.lora_registered:
                continue  # serves no adapter (or runs without LoRA)
            card = status.model_card
            max_loras = card.max_loras if card is not None else 0
            resident = set(stats.lora_resident)
            in_flight = status.in_flight_adapters
            lora_info.add_metric(
                [
                    str(max_loras),
                    ",".join(sorted(in_flight & resident)),
                    ",".join(sorted(in_flight - resident)),
                    status.address,
                ],
                status.last_heartbeat,
            )
            lora_resident.add_metric(key, len(stats.lora_resident))
            lora_registered.add_metric(key, len(stats.lora_registered))
            lora_loads.add_metric(key, stats.lora_loads)
            lora_evictions.add_metric(key, stats.lora_evictions)
        yield from (alive, running, waiting, kv_usage)
        yield from (vllm_running, vllm_waiting, vllm_kv_usage, queries, hits)
        yield from (lora_info, lora_resident, lora_registered, lora_loads, lora_evictions)
        yield from self._spec_decode()

    def _spec_decode(self) -> Iterator[Metric]:
        """vLLM's speculative decoding counters, per worker, for workers that speculate:
        drafts (verify events), draft tokens, accepted tokens and accepted tokens by draft
        position (label `position`, vLLM's acceptance length distribution). vLLM has no
        method label (one engine, one method); duet's `duet_worker_spec_decode_info` names
        each worker's method, so `* on(worker) group_left(method)` splits any of them by
        method."""
        labels = ["model_name", "worker"]
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels=labels
        )
        drafted = CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels=labels
        )
        accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels=labels
        )
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft's position.",
            labels=[*labels, "position"],
        )
        method = GaugeMetricFamily(
            "duet_worker_spec_decode_info",
            "The worker's speculative decoding method (1 while it speculates).",
            labels=["worker", "method"],
        )
        for status in self._statuses():
            stats = status.stats
            if stats is None or (stats.spec_method is None and not stats.spec_num_draft_tokens):
                continue  # does not speculate (a peer older than spec_method: has not drafted)
            key = [self._model_name, status.address]
            drafts.add_metric(key, stats.spec_num_drafts)
            drafted.add_metric(key, stats.spec_num_draft_tokens)
            accepted.add_metric(key, stats.spec_num_accepted_tokens)
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_position.add_metric([*key, str(position)], count)
            if stats.spec_method is not None:
                method.add_metric([status.address, stats.spec_method], 1)
        yield from (drafts, drafted, accepted, per_position, method)


class GenerationMetrics:
    """Counters and histograms of chat/completions requests, on the app's registry.

    `model_name`, the served model's name, is the `model_name` label of the `vllm:*` names.
    """

    def __init__(
        self,
        metrics: MetricsHost,
        worker_statuses: Callable[[], list[WorkerStatus]] | None = None,
        *,
        model_name: str,
    ) -> None:
        registry = metrics.registry
        self.ttft = _Family(
            "duet_render_time_to_first_token_seconds",
            "From receiving the request to its first generated token.",
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        ).histogram(metrics, model_name, _LATENCY_BUCKETS, VLLM_TTFT_BUCKETS)
        self.itl = _Family(
            "duet_render_inter_token_latency_seconds",
            "Time between two deltas of one choice.",
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
        ).histogram(metrics, model_name, _ITL_BUCKETS, VLLM_ITL_BUCKETS)
        self.e2e = _Family(
            "duet_render_e2e_request_latency_seconds",
            "From receiving the request to its last token.",
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
        ).histogram(metrics, model_name, _LATENCY_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue_time = _Family(
            "duet_render_queue_time_seconds",
            "Time a request waited in a worker's queue before its first step.",
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        ).histogram(metrics, model_name, _LATENCY_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = _Family(
            "duet_render_prompt_tokens",
            "Prompt tokens of finished requests.",
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
        ).counter(metrics, model_name)
        self.generation_tokens = _Family(
            "duet_render_generation_tokens",
            "Tokens generated.",
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
        ).counter(metrics, model_name)
        self.requests = Counter(
            "duet_render_requests_finished",
            "Choices finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        metrics.add_view("duet_render_requests_finished", _request_success_view(model_name))
        self.routed = Counter(
            "duet_render_requests_routed",
            "Choices sent to each worker.",
            ["worker"],
            registry=registry,
        )
        if worker_statuses is not None:
            # Live: each process reports its own view of the workers, never a sum.
            metrics.register_live(_WorkerCollector(worker_statuses, model_name))

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
