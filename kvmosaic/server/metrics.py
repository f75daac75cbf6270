"""Prometheus metrics named as vLLM names them, with ``kvmosaic:`` in place of ``vllm:``.

A dashboard built for vLLM carries over by replacing the prefix:

=====================================================  =======================================
``kvmosaic:prefix_cache_queries_total``                prompt tokens looked up in the cache
``kvmosaic:prefix_cache_hits_total``                   of those, tokens found (a hit rate is
                                                       ``hits / queries``)
``kvmosaic:kv_cache_usage_perc``                       fraction of blocks in use (0 to 1)
``kvmosaic:num_requests_running`` / ``_waiting``       scheduler queues
``kvmosaic:num_preemptions_total``                     preemptions (by recompute)
``kvmosaic:prompt_tokens_total``                       prompt tokens of requests that started
``kvmosaic:generation_tokens_total``                   tokens generated
``kvmosaic:request_success_total{finished_reason}``    finished requests: stop, length, abort
``kvmosaic:time_to_first_token_seconds``               histogram
``kvmosaic:e2e_request_latency_seconds``               histogram
=====================================================  =======================================

storage tiers (``kv_tiers``), labelled ``tier`` and ``medium``: ``kvmosaic:kv_tier_queries_total``,
``_hits_total`` (tokens supplied), ``_lookup_hits_total``, ``_bytes_stored_total``,
``_bytes_loaded_total``, ``_evictions_total``, ``_corrupt_entries_total``, ``_errors_total``,
``_late_loads_total``, gauges ``kvmosaic:kv_tier_used_bytes`` / ``_capacity_bytes`` / ``_up`` (Redis
state) and the histogram ``kvmosaic:kv_tier_load_latency_seconds``;

and our own: ``kvmosaic:kv_cache_num_blocks``, ``kvmosaic:kv_cache_free_blocks`` (free or
evictable), ``kvmosaic:kv_cache_cached_blocks`` (indexed), ``kvmosaic:kv_cache_evictions_total`` (both
backends), ``kvmosaic:kv_events_dropped_total`` and ``kvmosaic:fair_share_anticipation_holds_total`` /
``_hits_total`` / ``_held_seconds_total`` (engine/anticipation.py); automatic reuse's
``kvmosaic:auto_reuse_requests_total`` / ``_tokens_total`` / ``_fallbacks_total`` / ``_repairs_total`` /
``_repaired_tokens_total`` and its shadow audit's ``kvmosaic:auto_reuse_audits_total`` /
``_audits_over_bound_total`` / ``_audits_failed_total`` / ``_audits_skipped_total`` / ``_audit_seconds_total`` /
``_audited_tokens_total`` / ``_audit_trips_total``, the histogram ``kvmosaic:auto_reuse_audit_kl``, per tenant
``kvmosaic:tenant_auto_reuse_audits_total`` / ``_audits_over_bound_total`` and the gauge
``kvmosaic:auto_reuse_namespaces_off``.
Counters and gauges are read at scrape time from a snapshot the engine thread takes for that scrape, so
they cannot drift from what the engine counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..blend.shadow import MAX_IN_FLIGHT
from ..engine.output_processor import RequestOutput
from ..engine.stats import EngineStats

PREFIX = "kvmosaic:"
TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        st, labels = self.stats(), [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.prefix_cache_hits)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", st.kv_cache_usage)
        yield gauge("num_requests_running", "Requests in the running batch.", st.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting)
        yield counter("num_preemptions", "Requests preempted (their KV freed and recomputed).", st.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of requests that produced a first token.", st.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", st.generation_tokens)
        yield counter("kv_cache_evictions", "Cached blocks evicted to make room.", st.num_evictions)
        yield gauge("kv_cache_num_blocks", "KV blocks in the pool.", st.num_blocks)
        yield gauge("kv_cache_free_blocks", "KV blocks not in use (truly free or evictable).", st.num_free_blocks)
        yield gauge("kv_cache_cached_blocks", "KV blocks in the content index (in use or evictable).",
                    st.num_cached_blocks)
        yield counter("kv_events_dropped", "Cache events dropped before publishing (a subscriber sees a gap).",
                      st.num_events_dropped)
        yield counter("auto_reuse_requests", "Requests answered with KV of chunks found automatically "
                      "(--segment-reuse auto).", getattr(st, "auto_reuse_requests", 0))
        yield counter("auto_reuse_tokens", "Prompt tokens whose KV came from chunks found automatically.",
                      getattr(st, "auto_reuse_tokens", 0))
        yield counter("auto_reuse_fallbacks", "Requests whose drift estimate exceeded --auto-reuse-max-drift: "
                      "recomputed from the first reused token.", getattr(st, "auto_reuse_fallbacks", 0))
        yield counter("auto_reuse_repairs", "Requests whose blend recomputed more reused tokens than "
                      "--blend-ratio asks, to bring the drift estimate within --auto-reuse-max-drift.",
                      getattr(st, "auto_reuse_repairs", 0))
        yield counter("auto_reuse_repaired_tokens", "Reused tokens those repairs recomputed.",
                      getattr(st, "auto_reuse_repaired_tokens", 0))
        yield from audit_metrics(st, self.model_name)
        yield counter("fair_share_anticipation_holds", "Idle periods of one-request-at-a-time tenants the next "
                      "step was held for (--fair-share-anticipation-ms).", getattr(st, "anticipation_holds", 0))
        yield counter("fair_share_anticipation_hits", "Of those, the tenant's next request came inside the hold.",
                      getattr(st, "anticipation_hits", 0))
        yield counter("fair_share_anticipation_held_seconds", "Seconds the engine held steps for them.",
                      getattr(st, "anticipation_held_seconds", 0.0))
        yield from tier_metrics(getattr(st, "kv_tiers", None) or {}, self.model_name)


#: Storage-tier counters (``EngineStats.kv_tiers``), labelled ``tier`` (its name) and ``medium``.
_TIER_COUNTERS = (
    ("kv_tier_queries", "queries", "Blocks looked up in the tier."),
    ("kv_tier_hits", "hit_tokens", "Prompt tokens the tier supplied to requests."),
    ("kv_tier_lookup_hits", "hits", "Blocks a lookup found in the tier."),
    ("kv_tier_bytes_stored", "bytes_stored", "Bytes written to the tier."),
    ("kv_tier_bytes_loaded", "bytes_loaded", "Bytes read from the tier."),
    ("kv_tier_evictions", "evictions", "Entries the tier evicted to stay in its bound."),
    ("kv_tier_corrupt_entries", "corrupt", "Entries that failed a check (dropped, counted as misses)."),
    ("kv_tier_errors", "errors", "I/O or connection errors (each a miss)."),
    ("kv_tier_late_loads", "late_loads", "Loads past their deadline (the tokens were computed)."),
)


def tier_metrics(tiers_stats: dict, model_name: str) -> Iterator[Metric]:
    """``kvmosaic:kv_tier_*{tier=...}``: counters, used/capacity bytes, state (1 up, 0 down) and
    the load latency histogram, per storage tier."""
    from ..tiers.stats import LATENCY_BUCKETS as TIER_BUCKETS

    tiers = tiers_stats.get("tiers", {})
    if not tiers:
        return
    names = ["model_name", "tier", "medium"]
    for metric, key, doc in _TIER_COUNTERS:
        m = CounterMetricFamily(PREFIX + metric, doc, labels=names)
        for name, s in tiers.items():
            m.add_metric([model_name, name, s["medium"]], s.get(key, 0))
        yield m
    for metric, key, doc in (("kv_tier_used_bytes", "used_bytes", "Bytes the tier holds."),
                             ("kv_tier_capacity_bytes", "capacity_bytes", "The tier's bound in bytes (0: none)."),
                             ("kv_tier_up", "state", "1 when the tier is up, 0 when down (Redis outage).")):
        m = GaugeMetricFamily(PREFIX + metric, doc, labels=names)
        for name, s in tiers.items():
            v = (s["state"] == "up") if key == "state" else (s.get(key) or 0)
            m.add_metric([model_name, name, s["medium"]], float(v))
        yield m
    h = HistogramMetricFamily(PREFIX + "kv_tier_load_latency_seconds", "Latency of a tier get().", labels=names)
    for name, s in tiers.items():
        h.add_metric([model_name, name, s["medium"]], cumulative(TIER_BUCKETS, s["load_latency_buckets"]),
                     s["load_latency_sum"])
    yield h


def cumulative(bounds, counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts (+Inf last) as a Prometheus histogram's cumulative ``(le, count)`` pairs."""
    out, cum = [], 0
    for le, n in zip([*map(str, bounds), "+Inf"], counts):
        cum += n
        out.append((le, cum))
    return out


def audit_metrics(st: EngineStats, model_name: str) -> Iterator[Metric]:
    """The shadow audit of automatic reuse (``--auto-reuse-audit-rate``, blend/shadow.py): its counters
    and the histogram of the KL it measured; the histogram only once an audit ran."""
    for name, doc, value in (
            ("auto_reuse_audits", "Answers from automatically reused KV measured against a full prefill "
                                  "(--auto-reuse-audit-rate).", st.auto_reuse_audits),
            ("auto_reuse_audits_over_bound", "Of those, answers whose measured KL to the full prefill exceeded "
                                             "the bound (--auto-reuse-audit-bound, else --auto-reuse-max-drift).",
             st.auto_reuse_audits_over_bound),
            ("auto_reuse_audits_failed", "Audits that failed (logged; no request affected).",
             st.auto_reuse_audits_failed),
            ("auto_reuse_audits_skipped", f"Answers drawn for an audit while the most audits that may be open "
                                          f"were ({MAX_IN_FLIGHT}): not audited.", st.auto_reuse_audits_skipped),
            ("auto_reuse_audit_seconds", "Seconds the engine spent auditing (between steps).",
             st.auto_reuse_audit_seconds),
            ("auto_reuse_audited_tokens", "Answer tokens those audits covered (--auto-reuse-audit-tokens each, "
                                          "fewer for shorter answers).", st.auto_reuse_audited_tokens),
            ("auto_reuse_audit_trips", "Times a namespace's audited answers drifted over the bound often enough "
                                       "to turn its automatic reuse off (--auto-reuse-audit-trip).",
             st.auto_reuse_audit_trips)):
        m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        m.add_metric([model_name], value)
        yield m
    tenants = st.auto_reuse_audit_tenants or {}
    for name, key, doc in (("tenant_auto_reuse_audits", "audits", "Audited answers from reused KV, by tenant."),
                           ("tenant_auto_reuse_audits_over_bound", "over_bound",
                            "Of those, answers whose measured KL exceeded the bound, by tenant.")):
        m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "tenant"])
        for label, fig in sorted(tenants.items()):
            m.add_metric([model_name, label], fig[key])
        yield m
    off = GaugeMetricFamily(PREFIX + "auto_reuse_namespaces_off", "Namespaces whose automatic reuse is off now "
                            "(the breaker, --auto-reuse-audit-trip).", labels=["model_name"])
    off.add_metric([model_name], st.auto_reuse_namespaces_off)
    yield off
    kl = st.auto_reuse_audit_kl
    if not kl:
        return
    h = HistogramMetricFamily(PREFIX + "auto_reuse_audit_kl", "KL from a full prefill's next-token distributions "
                              "to the ones an audited answer's tokens were drawn from, the mean over its first "
                              "--auto-reuse-audit-tokens (nats).",
                              labels=["model_name"])
    h.add_metric([model_name], cumulative(kl["buckets"], kl["counts"]), kl["sum"])
    yield h


class ServerMetrics:
    """The registry behind ``/metrics``: engine counters plus per-request observations."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(stats, model_name))
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        # Issue 14: every request that ended without finishing, by reason.
        self.request_failures = Counter(
            PREFIX + "request_failures", "Requests that failed (sampling, output_processing, step).",
            ["model_name", "reason"], registry=self.registry)
        self.request_aborts = Counter(
            PREFIX + "request_aborts", "Requests aborted (client_disconnect, shutdown, step_error).",
            ["model_name", "reason"], registry=self.registry)
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused before the engine (draining, too_large, ...).",
            ["model_name", "reason"], registry=self.registry)
        # labelled by tenant_label (a non-reversible label per configured API key: bounded)
        self.tenant_rejected = Counter(
            PREFIX + "tenant_requests_rejected", "Requests refused with 429: their tenant was over its limits.",
            ["model_name", "tenant"], registry=self.registry)

    def tenant_over_limit(self, tenant: str) -> None:
        self.tenant_rejected.labels(self.model_name, tenant).inc()
        self.count("rejected", "tenant_limit")

    def count(self, kind: str, reason: str) -> None:
        """``kind``: "failure", "abort" or "rejected"; thread-safe."""
        counter = {"failure": self.request_failures, "abort": self.request_aborts}.get(kind, self.requests_rejected)
        counter.labels(self.model_name, reason).inc()

    def on_finish(self, out: RequestOutput) -> None:
        """Called once per request, from the engine thread, when it finishes or is aborted
        (a failed request is counted by :meth:`count` instead)."""
        if out.finish_reason == "error":
            return
        self.request_success.labels(self.model_name, out.finish_reason or "abort").inc()
        if out.finish_reason == "abort":
            return
        if out.metrics.get("ttft") is not None:
            self.ttft.labels(self.model_name).observe(out.metrics["ttft"])
        if out.metrics.get("e2e") is not None:
            self.e2e.labels(self.model_name).observe(out.metrics["e2e"])
