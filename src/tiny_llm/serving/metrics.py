"""The server's Prometheus metrics (``GET /metrics``): request counts and latencies (time to
first token, between tokens, per request), and the engine's load read at scrape time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tiny_llm.engine import LLMEngine

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# ANCHOR: metrics
class Metrics:
    """Latency histograms observed by the handlers, plus the engine's gauges and counters
    read at scrape time (``collect``)."""

    def __init__(self, engine: LLMEngine, aborted):
        from prometheus_client import CollectorRegistry, Histogram

        self.engine, self.aborted = engine, aborted
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=BUCKETS, registry=self.registry)

        self.ttft = histogram("tiny_llm_time_to_first_token_seconds",
                              "From arrival to the first output token")
        self.itl = histogram("tiny_llm_inter_token_latency_seconds",
                             "Between consecutive output tokens of a request")
        self.tpot = histogram("tiny_llm_time_per_output_token_seconds",
                              "A finished request's decode time per token after the first")
        self.e2e = histogram("tiny_llm_e2e_request_latency_seconds",
                             "From arrival to the last output")
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats, load = self.engine.stats(), self.engine.current_load()
        yield GaugeMetricFamily("tiny_llm_num_requests_running", "Requests running",
                                value=load.num_running)
        yield GaugeMetricFamily("tiny_llm_num_requests_waiting", "Requests waiting",
                                value=load.num_waiting)
        yield CounterMetricFamily("tiny_llm_num_preemptions", "Requests preempted",
                                  value=stats["num_preemptions"])
        yield CounterMetricFamily("tiny_llm_num_aborted_requests",
                                  "Requests aborted because their client went away",
                                  value=self.aborted())
        yield CounterMetricFamily("tiny_llm_generation_tokens", "Output tokens",
                                  value=stats["num_generated_tokens"])
        yield CounterMetricFamily("tiny_llm_prompt_tokens_computed", "Prompt tokens computed",
                                  value=stats["num_prompt_tokens_computed"])
        if load.num_pages is not None:
            yield GaugeMetricFamily("tiny_llm_kv_pages_in_use", "KV pages held",
                                    value=load.num_pages - load.num_free_pages)
            yield GaugeMetricFamily("tiny_llm_kv_pages_total", "KV pages in the pool",
                                    value=load.num_pages)
            queried = stats["prefix_cache_query_tokens"]
            yield GaugeMetricFamily(
                "tiny_llm_prefix_cache_hit_rate", "Prompt tokens served from cached pages, "
                "as a share of the prompt tokens looked up",
                value=stats["prefix_cache_hit_tokens"] / queried if queried else 0.0)


@dataclass
class Timeline:
    """When a request arrived and produced tokens (for the latency histograms)."""

    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def tokens_out(self, metrics: Metrics, n: int) -> None:
        if n == 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            metrics.ttft.observe(now - self.arrival)
        else:
            metrics.itl.observe((now - self.last) / n)
        self.last, self.tokens = now, self.tokens + n

    def done(self, metrics: Metrics) -> None:
        end = time.perf_counter()
        metrics.e2e.observe(end - self.arrival)
        if self.first is not None and self.tokens > 1:
            metrics.tpot.observe((self.last - self.first) / (self.tokens - 1))
# ANCHOR_END: metrics
