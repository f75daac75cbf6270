"""The router's Prometheus metrics, on their own registry (served at the router's /metrics).

* ``kvmosaic_router_decisions_total{policy, reason}``: reason in cache_hit / load_balance / fallback;
* ``kvmosaic_router_predicted_cached_tokens_total`` and ``..._reported_cached_tokens_total``: what
  the router expected a request to hit, and what the replica's ``usage`` then reported, both
  counted once per answered request (:meth:`answered`), so a retried request is not predicted
  twice; their ratio is the router's accuracy;
* ``kvmosaic_router_event_lag_seconds{replica}`` and ``kvmosaic_router_event_gaps{replica}``;
* ``kvmosaic_router_decision_seconds``: time spent in ``choose``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .index import ClusterIndex


class RouterMetrics:
    def __init__(self, policy: str, registry: CollectorRegistry | None = None) -> None:
        self.policy = policy
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvmosaic_router_decisions", "Routing decisions by reason",
                                 ["policy", "reason"], registry=r)
        self.predicted = Counter("kvmosaic_router_predicted_cached_tokens", "Cached tokens the router predicted",
                                 registry=r)
        self.reported = Counter("kvmosaic_router_reported_cached_tokens", "Cached tokens replicas reported",
                                registry=r)
        self.lag = Gauge("kvmosaic_router_event_lag_seconds", "Publish-to-apply lag of the latest event batch",
                         ["replica"], registry=r)
        self.gaps = Gauge("kvmosaic_router_event_gaps", "Event batches lost (not repaired)", ["replica"],
                          registry=r)
        self.decision_time = Histogram("kvmosaic_router_decision_seconds", "Time in the policy's choose",
                                       buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), registry=r)

    def decided(self, reason: str, seconds: float) -> None:
        self.decisions.labels(self.policy, reason).inc()
        self.decision_time.observe(seconds)

    def answered(self, predicted_tokens: int, reported_tokens: int) -> None:
        self.predicted.inc(predicted_tokens)
        self.reported.inc(reported_tokens)

    def observe_index(self, index: ClusterIndex) -> None:
        for rid, view in list(index.replicas.items()):
            self.lag.labels(rid).set(view.lag_s)
            self.gaps.labels(rid).set(view.gaps)
