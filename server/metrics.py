"""Prometheus metrics of one app instance (its own registry: apps in one process never collide).

Exposed at ``GET /metrics`` in the Prometheus text format:

* ``logitcache_http_requests_total{method,route,status}`` and
  ``logitcache_http_request_seconds{method,route}`` (latency histogram);
* ``logitcache_sequences_scored_total{source,teacher}`` /
  ``logitcache_tokens_scored_total{source,teacher}`` (``source`` = ``score`` for on-demand
  requests, ``job`` for batch jobs; prompt tokens; ``teacher``: the teacher's name, one service
  may serve several);
* ``logitcache_engine_seconds{source,teacher}``: latency of one engine call;
* ``logitcache_jobs{state}``: jobs per state; ``logitcache_job_sequences_done{job}``,
  ``logitcache_job_tokens_done{job}``, ``logitcache_job_tokens_total{job}`` for the running job;
* ``logitcache_cache_hits_total{teacher}`` / ``logitcache_cache_misses_total{teacher}``
  (sequences of cache-backed requests answered from the cache / scored),
  ``logitcache_cache_tokens_saved_total{teacher}`` (their prompt tokens) and
  ``logitcache_cache_bytes_served_total{teacher}`` (in-memory bytes of the hit arrays).

A teacher's services record through :meth:`Metrics.for_teacher`, which labels them.
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
            "logitcache_sequences_scored", "sequences scored", ["source", "teacher"], registry=r
        )
        self.tokens = PCounter(
            "logitcache_tokens_scored", "prompt tokens scored", ["source", "teacher"], registry=r
        )
        self.engine_seconds = Histogram(
            "logitcache_engine_seconds",
            "latency of one engine score call",
            ["source", "teacher"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        def cache(name: str, doc: str) -> PCounter:
            return PCounter(f"logitcache_cache_{name}", doc, ["teacher"], registry=r)

        def job(name: str, doc: str) -> Gauge:
            return Gauge(f"logitcache_job_{name}", doc, ["job"], registry=r)

        self.cache_hits = cache("hits", "sequences answered from a cache (no engine work)")
        self.cache_misses = cache("misses", "sequences of cache-backed requests scored")
        self.cache_tokens_saved = cache("tokens_saved", "prompt tokens answered from a cache")
        served = "bytes of cached arrays answered (ids, logprobs, tail, tokens; in memory)"
        self.cache_bytes_served = cache("bytes_served", served)
        self.job_sequences_done = job("sequences_done", "sequences done of a running job")
        self.job_tokens_done = job("tokens_done", "prompt tokens done of a running job")
        self.job_tokens_total = job("tokens_total", "prompt tokens of a running job")

    def for_teacher(self, teacher: str) -> TeacherMetrics:
        """The scoring and cache counters as teacher ``teacher`` records them (labelled)."""
        return TeacherMetrics(self, teacher)

    def cache_line(self, teacher: str | None = None) -> str:
        """The cache counters of ``teacher`` (``None``: all teachers together) in one line (status
        page): hit rate over cache-backed sequences."""
        counters = {
            "hits": self.cache_hits,
            "misses": self.cache_misses,
            "tokens_saved": self.cache_tokens_saved,
            "bytes_served": self.cache_bytes_served,
        }

        def get(name: str) -> int:
            samples = (s for m in counters[name].collect() for s in m.samples)
            return int(
                sum(
                    s.value
                    for s in samples
                    if s.name.endswith("_total")
                    and (teacher is None or s.labels.get("teacher") == teacher)
                )
            )

        hits, misses = get("hits"), get("misses")
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
        return (
            f"{hits} hits / {misses} misses ({rate}); {get('tokens_saved')} tokens saved, "
            f"{get('bytes_served')} bytes served"
        )

    def watch_job_states(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Report ``logitcache_jobs{state}`` from ``counts()`` (state -> jobs) at every scrape."""
        self.registry.register(_JobStateCollector(counts))

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


class TeacherMetrics:
    """One teacher's view of :class:`Metrics`: its engine calls and cache answers, labelled with
    its name (``teacher``)."""

    def __init__(self, metrics: Metrics, teacher: str) -> None:
        self.metrics, self.teacher = metrics, teacher

    def scored(self, source: str, *, sequences: int, tokens: int, seconds: float) -> None:
        """Count one engine call of ``sequences`` (``tokens`` prompt tokens) for ``source``."""
        m, t = self.metrics, self.teacher
        m.sequences.labels(source, t).inc(sequences)
        m.tokens.labels(source, t).inc(tokens)
        m.engine_seconds.labels(source, t).observe(seconds)

    def cache_served(self, *, hits: int, misses: int, tokens_saved: int, bytes_served: int) -> None:
        """Count one cache-backed answer (``server/serving/cache_hits.py``)."""
        m, t = self.metrics, self.teacher
        m.cache_hits.labels(t).inc(hits)
        m.cache_misses.labels(t).inc(misses)
        m.cache_tokens_saved.labels(t).inc(tokens_saved)
        m.cache_bytes_served.labels(t).inc(bytes_served)


def scraped_total(text: str, name: str, **labels: str) -> float:
    """The sum of sample ``name`` over the label sets of a ``/metrics`` page ``text`` that have
    ``labels`` (and ``teacher``, if given); 0 when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
