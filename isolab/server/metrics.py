"""Owns the Prometheus metrics: counts and gauges only, never prompt or output text, never tenants.

Each app gets its own CollectorRegistry (tests start several servers in one process). Engine
figures come from the engine thread's stats snapshot, read at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from isolab.models.invariance import InvarianceReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (stats key, metric name, help, kind)
ENGINE_FIGURES = (
    ("running", "isolab_num_requests_running", "engine requests being computed", "gauge"),
    ("kv_blocks_used", "isolab_kv_blocks_used", "KV blocks held by running requests (cached blocks no request holds count as free)", "gauge"),
    ("kv_blocks_free", "isolab_kv_blocks_free", "KV blocks free (including evictable cached ones)", "gauge"),
    ("kv_blocks_total", "isolab_kv_blocks_total", "usable KV blocks", "gauge"),
    ("prefix_cache_queries_tokens", "isolab_prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache", "counter"),
    ("prefix_cache_hits_tokens", "isolab_prefix_cache_hits_tokens", "prompt tokens served from the prefix cache", "counter"),
    ("preemptions", "isolab_preemptions", "requests preempted for lack of KV blocks", "counter"),
    ("evictions", "isolab_kv_evictions", "cached KV blocks evicted for reuse", "counter"),
    ("audit_violations", "isolab_audit_violations", "isolation violations caught by audit mode", "counter"),
    ("steps", "isolab_engine_steps", "engine steps run", "counter"),
)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, float]], queue_length: Callable[[], int]) -> None:
        self.snapshot = snapshot
        self.queue_length = queue_length

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.snapshot()
        for key, name, doc, kind in ENGINE_FIGURES:
            value = float(stats.get(key, 0))
            yield GaugeMetricFamily(name, doc, value=value) if kind == "gauge" else CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "isolab_num_requests_waiting",
            "engine requests admitted and waiting for a running slot (the queue length)",
            value=float(self.queue_length()),
        )


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, float]], queue_length: Callable[[], int],
                 numerics: InvarianceReport | None = None) -> None:
        self.registry = r = CollectorRegistry()
        if numerics is not None:  # what the isolation proof stands on, measured at start
            Gauge("isolab_batch_invariant", "1 if the start-up check found every GEMM and attention case "
                  "batch-invariant on this machine, else 0", registry=r).set(int(numerics.invariant))
            Info("isolab_numerics", "the numerics path the engine runs", registry=r).info(
                {"path": numerics.numerics, "gemm": numerics.gemm_path, "attention": numerics.attention,
                 "dtype": numerics.dtype, "kernel_isa": numerics.kernel_isa or "none",
                 "weights": numerics.weights, "qgemm_isa": numerics.qgemm_isa or "none"})
        self.http_requests = Counter(
            "isolab_http_requests", "HTTP requests answered, by route and status code", ["route", "code"], registry=r
        )
        self.requests_finished = Counter(
            "isolab_requests_finished", "engine requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("isolab_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("isolab_generation_tokens", "output tokens generated", registry=r)
        self.cached_tokens = Counter("isolab_cached_prompt_tokens", "prompt tokens reported as cached to clients", registry=r)
        self.rejected = Counter("isolab_requests_rejected", "requests refused before the engine, by reason", ["reason"], registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("isolab_time_to_first_token_seconds", "time to the first output token", buckets=buckets, registry=r)
        self.e2e = Histogram("isolab_request_latency_seconds", "time from arrival to the last token", buckets=buckets, registry=r)
        r.register(_EngineCollector(snapshot, queue_length))

    def render(self) -> bytes:
        return generate_latest(self.registry)
