"""Prometheus metrics of one render server app.

Each app owns its CollectorRegistry (never the global one), so two apps in one process
(tests, benchmarks) do not collide and /metrics shows only this app's numbers.

With `render-serve --processes N` every process writes its counters and histograms to
files in a shared directory (prometheus_client's multiprocess mode), and /metrics in any
of them sums the files of all, plus its own live collectors (the per-worker gauges).

A family may be exported through a view (`add_view`): what is recorded once is then
shown as one or more families at scrape time (e.g. a histogram under two names with two
sets of bucket edges), after the processes' numbers are summed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Anything else is folded into "other" so a client cannot grow the label space.
_KNOWN_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
# Route label for requests that matched no route (404s, and 401s decided before routing).
UNMATCHED_ROUTE = "unmatched"

View = Callable[[Metric], Iterable[Metric]]
"""What a recorded family is exported as (see `RenderMetrics.add_view`)."""

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class RenderMetrics:
    """The render server's counters and histograms, on a registry of their own.

    `multiprocess_dir`: the directory shared by the render processes of one server, for
    /metrics to sum them all. prometheus_client reads PROMETHEUS_MULTIPROC_DIR once, at
    import, to decide where values live; the two must agree (checked here).
    """

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
            raise RuntimeError(
                "metrics_multiprocess_dir is set but prometheus_client was imported without "
                "PROMETHEUS_MULTIPROC_DIR: counters would stay private to each process"
            )
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self._live: list[Collector] = []
        self._views: dict[str, View] = {}
        self.http_requests = Counter(
            "duet_render_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "duet_render_http_request_duration_seconds",
            "Time from receiving a request to finishing its response.",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.render_seconds = Histogram(
            "duet_render_chat_template_seconds",
            "Time spent rendering one chat template (and tokenizing the result).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens_tokenized = Counter(
            "duet_render_tokens_tokenized",
            "Token ids produced by /tokenize.",
            registry=self.registry,
        )
        # labels() takes a lock and builds a key per call; the label space is small and
        # bounded, so the children are cached to keep per-request overhead minimal.
        self._children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one finished HTTP request and record its latency."""
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            label_method = method if method in _KNOWN_METHODS else "other"
            children = (
                self.http_requests.labels(label_method, route, str(status)),
                self.http_latency.labels(label_method, route),
            )
            if method in _KNOWN_METHODS:
                self._children[key] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(seconds)

    def register_live(self, collector: Collector) -> None:
        """Add a collector that reads this process's state at scrape time (not summed
        across processes: e.g. this process's view of each worker)."""
        self.registry.register(collector)
        self._live.append(collector)

    def add_view(self, name: str, view: View) -> None:
        """Export the family `name` (as `Metric.name` spells it: a counter without
        `_total`) as whatever `view` makes of it, instead of as recorded."""
        self._views[name] = view

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric: this registry's, or with several
        processes the sum of all their counters and histograms plus our live collectors."""
        if self.multiprocess_dir is None:
            return generate_latest(_Viewed(self.registry, self._views))
        # A fresh registry per scrape, as prometheus_client's multiprocess docs prescribe:
        # the collector reads whatever files exist now, including newly started processes'.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.multiprocess_dir))
        for collector in self._live:
            registry.register(collector)
        return generate_latest(_Viewed(registry, self._views))


class _Viewed(Collector):
    """Every family of `source`, the ones with a view as the view shows them."""

    def __init__(self, source: CollectorRegistry, views: dict[str, View]) -> None:
        self._source = source
        self._views = views

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            view = self._views.get(family.name)
            if view is None:
                yield family
            else:
                yield from view(family)
