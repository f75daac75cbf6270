"""``/metrics`` for the cache lens (issue 23): miss reasons and per-tenant figures.

* ``kvmosaic:prefix_cache_miss_tokens_total{reason}``: prompt tokens not served from the cache,
  by reason (cache/miss_reasons.py: cold, evicted, tier_miss, partial_block, diverged,
  namespace). With ``kvmosaic:prefix_cache_tier_hit_tokens_total`` (tokens storage tiers
  served), ``sum(miss) + tier == prefix_cache_queries - prefix_cache_hits``;
* per tenant (``tenant``: the label ``TenantPolicy.tenant_label`` derives from the API key, ``-``
  for requests without one), at most ``top_n`` labels, the busiest by prompt tokens looked up,
  the rest summed as ``other``: ``kvmosaic:tenant_prefix_cache_queries_total``,
  ``..._cached_tokens_total`` (served from the pool or a tier), ``..._computed_tokens_total``
  (prefilled), gauges ``kvmosaic:tenant_prefix_cache_hit_rate`` and ``kvmosaic:tenant_kv_blocks_held``
  (blocks its running requests reference plus cached blocks it first asked for).

``/metrics`` is admin-only when keys are set, so the ``namespace`` reason and the tenants'
figures are seen by the admin alone. Values come from the stats snapshot the engine thread
takes for the scrape (``EngineStats.lens``), so they agree with the other counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..cache.lens import OTHER
from ..cache.miss_reasons import REASONS

PREFIX = "kvmosaic:"


def top_tenants(tenants: dict[str, dict], top_n: int) -> dict[str, dict]:
    """The ``top_n`` tenants with the most prompt tokens looked up (ties: by label), the rest
    (and any ``other`` already folded) summed into ``other``: at most ``top_n + 1`` labels."""
    ranked = sorted((t for t in tenants if t != OTHER), key=lambda t: (-tenants[t]["queries"], t))
    keep = {t: dict(tenants[t]) for t in ranked[:top_n]}
    rest = [tenants[t] for t in ranked[top_n:]] + ([tenants[OTHER]] if OTHER in tenants else [])
    if rest:
        keep[OTHER] = {k: sum(r.get(k, 0) for r in rest) for k in rest[0]}
    return keep


def hit_rate(fig: dict) -> float:
    return fig["cached"] / fig["queries"] if fig["queries"] else 0.0


class CacheLensCollector(Collector):
    def __init__(self, stats: Callable[[], object], model_name: str, top_n: int = 10) -> None:
        self.stats, self.model_name, self.top_n = stats, model_name, top_n

    def collect(self) -> Iterator[Metric]:
        lens = getattr(self.stats(), "lens", None) or {}
        if not lens:
            return
        m = CounterMetricFamily(PREFIX + "prefix_cache_miss_tokens", "Prompt tokens not served from the cache, "
                                "by reason.", labels=["model_name", "reason"])
        for reason in REASONS:
            m.add_metric([self.model_name, reason], lens["miss_tokens"].get(reason, 0))
        yield m
        t = CounterMetricFamily(PREFIX + "prefix_cache_tier_hit_tokens", "Prompt tokens storage tiers served.",
                                labels=["model_name"])
        t.add_metric([self.model_name], lens.get("tier_tokens", 0))
        yield t
        tenants = top_tenants(lens.get("tenants", {}), self.top_n)
        names = ["model_name", "tenant"]
        for metric, key, doc in (("tenant_prefix_cache_queries", "queries", "Prompt tokens looked up, by tenant."),
                                 ("tenant_prefix_cache_cached_tokens", "cached",
                                  "Prompt tokens served from the pool or a tier, by tenant."),
                                 ("tenant_prefix_cache_computed_tokens", "computed",
                                  "Prompt tokens prefilled (missed), by tenant.")):
            c = CounterMetricFamily(PREFIX + metric, doc, labels=names)
            for label, fig in tenants.items():
                c.add_metric([self.model_name, label], fig[key])
            yield c
        g = GaugeMetricFamily(PREFIX + "tenant_prefix_cache_hit_rate", "cached / looked-up prompt tokens, by tenant.",
                              labels=names)
        for label, fig in tenants.items():
            g.add_metric([self.model_name, label], hit_rate(fig))
        yield g
        b = GaugeMetricFamily(PREFIX + "tenant_kv_blocks_held", "KV blocks held, by tenant (referenced by its "
                              "running requests, or cached on its first request).", labels=names)
        for label, fig in tenants.items():
            b.add_metric([self.model_name, label], fig["blocks_held"])
        yield b
