"""Prometheus metrics for the server, on their own registry and HTTP port.

Per-request numbers (outcomes, TTFT, inter-token latency) are recorded as requests run; engine
state (queue, batch, KV blocks, prefix hits, preemptions, tokens/s) is read under the engine lock
at scrape time, so a scrape always sees one consistent engine state.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable

from baton.serve.core.stats import EngineStats
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from baton.serve.grammar import GrammarCacheStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineCollector:
    """Scrape-time engine gauges; `read()` returns the engine's stats, or None while loading."""

    def __init__(self, read: Callable[[], EngineStats | None], window_s: float = 10.0):
        self._read = read
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def _tokens_per_s(self, now: float, tokens: int) -> float:
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (tokens - n0) / (now - t0) if now > t0 else 0.0

    def collect(self):
        s = self._read()
        if s is None:
            return
        gauges = {
            "baton_queued_calls": ("Generation calls waiting for admission", s.queued_calls),
            "baton_engine_waiting_seqs": ("Sequences in the engine's waiting queue", s.waiting_seqs),
            "baton_running_batch_size": ("Sequences in the running batch", s.running_seqs),
            "baton_swapped_seqs": ("Sequences swapped out to host memory", s.swapped_seqs),
            "baton_prefix_cache_hit_rate": (
                "Share of prompt tokens served from the prefix cache",
                s.prefix_cache_hit_rate,
            ),
            "baton_generation_tokens_per_second": (
                f"Generated tokens per second over about {self._window_s:g} s",
                self._tokens_per_s(time.monotonic(), s.generation_tokens),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._speculative(s)
        exits = CounterMetricFamily(
            "baton_early_exit_tokens",
            "CALM early exit: decode tokens by the layers they ran (the largest: the full depth)",
            labels=["layers"],
        )
        for layers, n in zip(s.early_exit_layers, s.early_exit_tokens):
            exits.add_metric([str(layers)], n)
        yield exits
        kv = GaugeMetricFamily("baton_kv_blocks", "KV cache blocks by state", labels=["state"])
        kv.add_metric(["used"], s.kv_blocks_total - s.kv_blocks_free)
        kv.add_metric(["free"], s.kv_blocks_free)
        yield kv
        if s.kv_window_blocks_total:  # KV groups: the sliding-window layers' pool
            window = GaugeMetricFamily(
                "baton_kv_window_blocks", "Sliding-window layers' KV cache blocks by state", labels=["state"]
            )
            window.add_metric(["used"], s.kv_window_blocks_total - s.kv_window_blocks_free)
            window.add_metric(["free"], s.kv_window_blocks_free)
            yield window
        counters = {
            "baton_preemptions": ("Sequences preempted for lack of KV blocks", s.preemptions),
            "baton_prompt_tokens": ("Prompt tokens processed", s.prompt_tokens),
            "baton_generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)

    @staticmethod
    def _speculative(s: EngineStats):
        """The baton_spec_* families, each labelled with the method ("none": speculation is off)."""
        mode = [s.spec_method]
        gauges = {
            "baton_spec_acceptance_rate": ("accepted / proposed tokens since start", s.spec_acceptance_rate),
            "baton_spec_mean_accepted_length": ("tokens gained per verification pass", s.spec_mean_accepted_length),
            "baton_spec_speedup": (
                "decode speed-up measured against plain decode steps of the same batch size (0: not yet)",
                s.spec_speedup,
            ),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(name, "Speculative decoding: " + doc, labels=["method"])
            gauge.add_metric(mode, value)
            yield gauge
        counters = {
            "baton_spec_proposed_tokens": ("tokens proposed", s.spec_proposed_tokens),
            "baton_spec_accepted_tokens": ("proposed tokens the target accepted", s.spec_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(name, "Speculative decoding: " + doc, labels=["method"])
            counter.add_metric(mode, value)
            yield counter
        for what, counts in (("proposed", s.spec_proposed_by_depth), ("accepted", s.spec_accepted_by_depth)):
            doc = f"Speculative decoding: verification passes that {what} a token this deep"
            by_depth = CounterMetricFamily(f"baton_spec_{what}_by_depth", doc, labels=["method", "depth"])
            for d, n in enumerate(counts, start=1):
                by_depth.add_metric([*mode, str(d)], n)
            yield by_depth


class GrammarCollector:
    """Scrape-time counters of the engine's compiled-grammar cache (serve/grammar.GrammarCache), by
    spec kind: "structural_tag" is tool calling's tool sets, "json" response_format schemas, ...
    `read()` returns its GrammarCacheStats (the cache takes its own lock)."""

    def __init__(self, read: Callable[[], GrammarCacheStats]):
        self._read = read

    def collect(self):
        s = self._read()
        families = {
            "baton_grammar_cache_hits": ("Requests admitted with their grammar already compiled", s.hits),
            "baton_grammar_cache_misses": ("Requests that compiled their grammar", s.misses),
            "baton_grammar_compile_seconds": ("Seconds spent compiling grammars", s.compile_seconds),
        }
        for name, (doc, by_kind) in families.items():
            family = CounterMetricFamily(name, f"Structured outputs: {doc}, by kind", labels=["kind"])
            for kind, value in sorted(by_kind.items()):
                family.add_metric([kind], value)
            yield family


class ServerMetrics:
    def __init__(self, read_engine: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "baton_requests",
            "Finished requests by API and outcome (gRPC status)",
            ["api", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "baton_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "baton_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # tool calling (serve/openai/tool_calling.py), by --tool-call-parser name
        self.tool_calls = Counter(
            "baton_tool_calls", "Tool calls returned to clients, by parser", ["parser"], registry=self.registry
        )
        self.tool_call_parse_failures = Counter(
            "baton_tool_call_parse_failures",
            'Answers under tool_choice "auto" where a call was started but did not parse (returned as content)',
            ["parser"],
            registry=self.registry,
        )
        self.registry.register(EngineCollector(read_engine))
        self._http = None

    def watch_grammars(self, read: Callable[[], GrammarCacheStats]) -> None:
        """Export the engine's grammar cache counters (once the engine is loaded)."""
        self.registry.register(GrammarCollector(read))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server; returns the bound port (port 0 picks a free one)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
