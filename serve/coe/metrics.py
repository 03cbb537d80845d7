"""Prometheus metrics of a Composition of Experts, on the server's registry beside the engine's.

Route decisions (the router's pick and its confidence, how long routing took) are recorded as
requests arrive; requests by expert and by how they reached it (named, routed, fallback) are
counted; per-expert load (calls running and queued, KV blocks, readiness) is read at scrape time.
The engine gauges (baton_running_batch_size, ...) are the experts' sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from baton.serve.core.stats import EngineStats
from baton.serve.metrics import LATENCY_BUCKETS
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

# (expert name, ready, its engine's stats or None while not loaded), read at scrape time
ExpertLoads = Callable[[], Iterable[tuple[str, bool, EngineStats | None]]]

CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class ExpertLoadCollector:
    """Scrape-time gauges per expert (labelled `expert`)."""

    def __init__(self, loads: ExpertLoads):
        self.loads = loads

    def collect(self):
        gauges = {
            "baton_coe_expert_ready": "1 while the expert is loaded and serving",
            "baton_coe_expert_active_calls": "Generation calls in the expert's engine",
            "baton_coe_expert_queued_calls": "Generation calls waiting for the expert",
            "baton_coe_expert_running_seqs": "Sequences in the expert's running batch",
            "baton_coe_expert_kv_blocks_free": "Free KV blocks in the expert's pool",
        }
        families = {name: GaugeMetricFamily(name, doc, labels=["expert"]) for name, doc in gauges.items()}
        for name, ready, s in self.loads():
            families["baton_coe_expert_ready"].add_metric([name], float(ready))
            values = (s.active_calls, s.queued_calls, s.running_seqs, s.kv_blocks_free) if s else (0, 0, 0, 0)
            for metric, v in zip(list(families)[1:], values):
                families[metric].add_metric([name], v)
        yield from families.values()


class CoEMetrics:
    def __init__(self, registry: CollectorRegistry, loads: ExpertLoads):
        self.requests = Counter(
            "baton_coe_requests",
            "Generation requests by expert and how they reached it (named, routed, fallback)",
            ["expert", "how"],
            registry=registry,
        )
        self.decisions = Counter(
            "baton_coe_route_decisions", "Router decisions by the expert it picked", ["expert"], registry=registry
        )
        self.confidence = Histogram(
            "baton_coe_route_confidence",
            "The router's confidence in its pick",
            buckets=CONFIDENCE_BUCKETS,
            registry=registry,
        )
        self.seconds = Histogram(
            "baton_coe_route_seconds", "Time the router took per request", buckets=LATENCY_BUCKETS, registry=registry
        )
        registry.register(ExpertLoadCollector(loads))

    def observe_route(self, expert: str, confidence: float, seconds: float) -> None:
        self.decisions.labels(expert).inc()
        self.confidence.observe(confidence)
        self.seconds.observe(seconds)
