"""`/metrics` in Prometheus text, with prometheus_client. Names follow vLLM's where one exists
(`tinydet_` instead of `vllm:`); the engine's own counters are read when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; the latency buckets span a fast decode step to a long request.
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
            80.0)


class Metrics:
    def __init__(self, service):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tinydet_requests", "HTTP requests by outcome", ["endpoint", "outcome"], registry=r)
        self.finished = Counter("tinydet_request_success", "Choices finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tinydet_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tinydet_generation_tokens", "Tokens generated", registry=r)
        self.queue_time = Histogram("tinydet_request_queue_time_seconds", "From arrival to a KV slot",
                                    buckets=_LATENCY, registry=r)
        self.ttft = Histogram("tinydet_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tinydet_inter_token_latency_seconds", "Between consecutive tokens of a choice",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tinydet_e2e_request_latency_seconds", "From arrival to the last token",
                             buckets=_LATENCY, registry=r)
        self.canary_runs = Counter("tinydet_canary_runs", "Determinism canary runs", registry=r)
        self.canary_mismatches = Counter("tinydet_canary_mismatches", "Canary runs whose hashes differed from the "
                                         "recorded ones", registry=r)
        self.ready = Gauge("tinydet_ready", "1 when the model is loaded and the start canary passed", registry=r)
        r.register(_EngineCollector(service))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters kept by the engine, read at scrape time."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        engine = self.service.engine
        running, waiting = engine.counts if engine is not None else (0, 0)
        slots = engine.max_batch if engine is not None else 0
        yield GaugeMetricFamily("tinydet_num_requests_running", "Sequences holding a KV slot", value=running)
        yield GaugeMetricFamily("tinydet_num_requests_waiting", "Sequences waiting for a KV slot", value=waiting)
        yield GaugeMetricFamily("tinydet_kv_slots_used", "KV-cache slots in use", value=running)
        yield GaugeMetricFamily("tinydet_kv_slots_total", "KV-cache slots (--max-batch)", value=slots)
        yield GaugeMetricFamily("tinydet_kv_cache_usage_perc", "Share of KV-cache slots in use",
                                value=running / slots if slots else 0.0)
        stats = engine.stats if engine is not None else {}
        prefix = engine.prefix if engine is not None else None
        for name, doc, v in (
                ("tinydet_engine_steps", "Forward passes", stats.get("steps", 0)),
                ("tinydet_prompt_tokens_computed", "Prompt tokens run through the model (not from the prefix cache)",
                 stats.get("prompt_tokens_computed", 0)),
                ("tinydet_prefix_cache_queries", "Admitted requests that looked up the prefix cache",
                 prefix.queries if prefix else 0),
                ("tinydet_prefix_cache_hits", "Requests that reused a cached prefix", prefix.hits if prefix else 0),
                ("tinydet_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                 prefix.hit_tokens if prefix else 0),
                ("tinydet_prefix_cache_evictions", "Blocks evicted from the prefix cache",
                 prefix.evictions if prefix else 0),
                ("tinydet_speculative_draft_tokens", "Tokens proposed by the speculative drafter (--speculative)",
                 stats.get("draft_tokens", 0)),
                ("tinydet_speculative_accepted_tokens", "Proposed tokens the model chose too and kept",
                 stats.get("draft_accepted", 0))):
            yield CounterMetricFamily(name, doc, value=v)
        yield GaugeMetricFamily("tinydet_prefix_cache_bytes", "Bytes held by the prefix cache",
                                value=prefix.nbytes if prefix else 0)
