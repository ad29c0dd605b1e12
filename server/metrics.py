"""Prometheus metrics of one app instance (its own registry: apps in one process never collide).

Exposed at ``GET /metrics`` in the Prometheus text format:

* ``logitcache_http_requests_total{method,route,status}`` and
  ``logitcache_http_request_seconds{method,route}`` (latency histogram);
* ``logitcache_sequences_scored_total{source}`` / ``logitcache_tokens_scored_total{source}``
  (``source`` = ``score`` for on-demand requests, ``job`` for batch jobs; prompt tokens);
* ``logitcache_engine_seconds{source}``: latency of one engine call;
* ``logitcache_jobs{state}``: jobs per state; ``logitcache_job_sequences_done{job}``,
  ``logitcache_job_tokens_done{job}``, ``logitcache_job_tokens_total{job}`` for the running job;
* ``logitcache_cache_hits_total`` / ``logitcache_cache_misses_total`` (sequences of cache-backed
  requests answered from the cache / scored), ``logitcache_cache_tokens_saved_total`` (their
  prompt tokens) and ``logitcache_cache_bytes_served_total`` (in-memory bytes of the hit arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _JobStateCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]):
        self._counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily("logitcache_jobs", "jobs per state", labels=["state"])
        for state, n in sorted(self._counts().items()):
            g.add_metric([state], n)
        yield g


class Metrics:
    """The service's metric objects, registered in :attr:`registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = PCounter(
            "logitcache_http_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "logitcache_http_request_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.sequences = PCounter(
            "logitcache_sequences_scored", "sequences scored", ["source"], registry=r
        )
        self.tokens = PCounter(
            "logitcache_tokens_scored", "prompt tokens scored", ["source"], registry=r
        )
        self.engine_seconds = Histogram(
            "logitcache_engine_seconds",
            "latency of one engine score call",
            ["source"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_hits = PCounter(
            "logitcache_cache_hits", "sequences answered from a cache (no engine work)", registry=r
        )
        self.cache_misses = PCounter(
            "logitcache_cache_misses", "sequences of cache-backed requests scored", registry=r
        )
        self.cache_tokens_saved = PCounter(
            "logitcache_cache_tokens_saved", "prompt tokens answered from a cache", registry=r
        )
        self.cache_bytes_served = PCounter(
            "logitcache_cache_bytes_served",
            "bytes of cached arrays answered (ids, logprobs, tail, tokens; in memory)",
            registry=r,
        )
        self.job_sequences_done = Gauge(
            "logitcache_job_sequences_done", "sequences done of a running job", ["job"], registry=r
        )
        self.job_tokens_done = Gauge(
            "logitcache_job_tokens_done", "prompt tokens done of a running job", ["job"], registry=r
        )
        self.job_tokens_total = Gauge(
            "logitcache_job_tokens_total", "prompt tokens of a running job", ["job"], registry=r
        )

    def cache_served(self, *, hits: int, misses: int, tokens_saved: int, bytes_served: int) -> None:
        """Count one cache-backed answer (``server/serving/cache_hits.py``)."""
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)
        self.cache_tokens_saved.inc(tokens_saved)
        self.cache_bytes_served.inc(bytes_served)

    def cache_line(self) -> str:
        """The cache counters in one line (status page): hit rate over cache-backed sequences."""

        def get(name: str) -> int:
            return int(self.registry.get_sample_value(f"logitcache_cache_{name}_total") or 0)

        hits, misses = get("hits"), get("misses")
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
        return (
            f"{hits} hits / {misses} misses ({rate}); {get('tokens_saved')} tokens saved, "
            f"{get('bytes_served')} bytes served"
        )

    def watch_job_states(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Report ``logitcache_jobs{state}`` from ``counts()`` (state -> jobs) at every scrape."""
        self.registry.register(_JobStateCollector(counts))

    def scored(self, source: str, *, sequences: int, tokens: int, seconds: float) -> None:
        self.sequences.labels(source).inc(sequences)
        self.tokens.labels(source).inc(tokens)
        self.engine_seconds.labels(source).observe(seconds)

    def job_progress(self, job: str, *, sequences_done: int, tokens_done: int, total: int) -> None:
        self.job_sequences_done.labels(job).set(sequences_done)
        self.job_tokens_done.labels(job).set(tokens_done)
        self.job_tokens_total.labels(job).set(total)

    def job_ended(self, job: str) -> None:
        for g in (self.job_sequences_done, self.job_tokens_done, self.job_tokens_total):
            try:
                g.remove(job)
            except KeyError:
                pass
