"""Prometheus metrics, named `kimik3:*` with vLLM's suffixes so existing dashboards port.

Engine state (running, waiting, prefix-cache tokens, KDA snapshots, cache usage, preemptions, aborts) is read from
the engine's `stats` copy at scrape time; token totals and latency histograms are the server's own, counted from
what it returned (so `prompt_tokens_total` is exactly the sum of the `usage.prompt_tokens` it reported).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics"]

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
# (metric name, engine stats key, help, counter?)
_ENGINE = (
    ("num_requests_running", "running", "Requests in the running batch.", False),
    ("num_requests_waiting", "waiting", "Requests waiting to be scheduled.", False),
    ("prefix_cache_queries", "prefix_queries_tokens", "Prompt tokens looked up in the prefix cache.", True),
    ("prefix_cache_hits", "prefix_hit_tokens", "Prompt tokens found in the prefix cache.", True),
    ("kda_snapshots", "kda_snapshots", "KDA state snapshots held by the prefix cache.", False),
    ("kda_snapshot_bytes", "kda_snapshot_bytes", "Bytes of KDA state snapshots held.", False),
    ("snapshots_rejected_nonfinite", "nonfinite_refused", "Snapshots refused for non-finite values.", True),
    ("cache_usage_ratio", "cache_usage", "Fraction of the cache pool in use (0..1).", False),
    ("num_preemptions", "preemptions", "Requests preempted (recomputed later).", True),
    ("num_aborted_requests", "aborts", "Requests aborted (client gone, stop string).", True),
    ("engine_prompt_tokens", "prompt_tokens_total", "Prompt tokens the engine received.", True),
    ("engine_generation_tokens", "generation_tokens_total", "Tokens the engine generated.", True),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative drafts verified.", True),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative draft tokens verified.", True),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
     True),
    ("expert_cache_hits", "expert_cache_hits", "Routed (token, expert) rows whose expert was in a device slot "
     "(tiered experts, --cpu-offload-gb).", True),
    ("expert_cache_misses", "expert_cache_misses", "Routed rows whose expert was in host memory only.", True),
    ("expert_cache_bytes_copied", "expert_cache_bytes_copied", "Expert bytes copied from host to device.", True),
)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        stats = self._stats() or {}
        for name, key, doc, counter in _ENGINE:
            value = float(stats.get(key, 0) or 0)
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(f"kimik3:{name}", doc)
            family.add_metric([], value)
            yield family


class Metrics:
    """One registry per server (tests run several in a process)."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("kimik3:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kimik3:generation_tokens", "Tokens returned by finished requests.",
                                         registry=r)
        self.cached_tokens = Counter("kimik3:cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.requests = Counter("kimik3:request_success", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("kimik3:time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("kimik3:inter_token_latency_seconds", "Gap between a request's engine outputs, per token.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kimik3:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY,
                             registry=r)
        self.queue = Histogram("kimik3:request_queue_time_seconds", "Time waiting before the first schedule.",
                               buckets=_LATENCY, registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
