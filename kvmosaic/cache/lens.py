"""Live miss reasons and per-tenant cache figures, counted at each admission (issue 23).

The scheduler calls :meth:`CacheLens.on_admit` once per admission, right after the manager's
``record_query`` (so ``prefix_cache_queries`` / ``_hits`` and these counters see the same
admissions, preemptions' re-admissions included). Invariants, per admission and summed:
``sum(miss_tokens.values()) + tier_tokens == queries - hits`` (the manager's ``stats``),
and per tenant ``cached + computed == queries``. A request's own breakdown
(``Sequence.miss_reasons``, the tenant view of :mod:`.miss_reasons`) is set at its first
admission, with the same tokens its ``cached_tokens`` leaves out.

Tenants are the labels the server derives from API keys (``TenantPolicy.tenant_label``: few,
stable, not reversible); at most ``max_tenants`` are tracked, later ones are folded into
``"other"``. No torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .miss_reasons import REASONS, MissBreakdown, classify
from .watch import CacheWatch

OTHER = "other"
NO_TENANT = "-"


@dataclass
class TenantFigures:
    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    cached: int = 0  # served from the pool or a tier
    computed: int = 0  # missed (prefilled)


class CacheLens:
    def __init__(self, mgr, watch: CacheWatch, max_tenants: int = 256) -> None:
        self.mgr = mgr
        self.watch = watch
        self.max_tenants = max_tenants
        self.miss_tokens: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.tier_tokens = 0
        self.tenants: dict[str, TenantFigures] = {}

    def tenant(self, label: str | None) -> TenantFigures:
        key = NO_TENANT if label is None else label
        fig = self.tenants.get(key)
        if fig is None:
            if len(self.tenants) >= self.max_tenants:
                key = OTHER
            fig = self.tenants.setdefault(key, TenantFigures())
        return fig

    def on_admit(self, seq, match, cached: int) -> MissBreakdown:
        """Count one admission: ``match`` from the manager, ``cached`` = pool hit + tier tokens."""
        mgr, bs = self.mgr, self.mgr.block_size
        tokens = seq.all_token_ids
        hashes = mgr.hasher(seq).update(tokens)
        tier_attempted = len(match.tier_hits) * bs
        out = classify(mgr, self.watch, seq, hashes, cached, tier_attempted, match.num_tokens)
        for reason, n in out.admin.items():
            self.miss_tokens[reason] += n
        self.tier_tokens += cached - match.num_tokens
        fig = self.tenant(seq.tenant)
        fig.requests += 1
        fig.queries += len(tokens)
        fig.cached += cached
        fig.computed += len(tokens) - cached
        self.watch.note_request(hashes[: (len(tokens) - 1) // bs], seq.tenant, time.time())
        if seq.num_cached_tokens < 0:  # first admission: the request's own figure
            seq.miss_reasons = out.tenant
        return out

    def blocks_held(self, running) -> dict[str, int]:
        """Per tenant: distinct blocks its running requests reference, plus cached blocks it
        first asked for that nobody references now."""
        pool, mgr = self.mgr.pool, self.mgr
        seen: dict[int, str] = {}
        for seq in running:
            label = self._label(seq.tenant)
            for bid in mgr.block_table(seq.request_id):
                seen.setdefault(bid, label)
        for h, block in pool.cached.items():
            if block.block_id not in seen:
                entry = self.watch.owner.get(h)
                seen[block.block_id] = self._label(entry[0] if entry else None)
        out: dict[str, int] = {}
        for label in seen.values():
            out[label] = out.get(label, 0) + 1
        return out

    def _label(self, tenant: str | None) -> str:
        key = NO_TENANT if tenant is None else tenant
        return key if key in self.tenants or len(self.tenants) < self.max_tenants else OTHER

    def snapshot(self, running=()) -> dict:
        """Plain data for the stats snapshot (taken on the engine thread)."""
        held = self.blocks_held(running)
        return {
            "miss_tokens": dict(self.miss_tokens),
            "tier_tokens": self.tier_tokens,
            "tenants": {t: {"requests": f.requests, "queries": f.queries, "cached": f.cached,
                            "computed": f.computed, "blocks_held": held.get(t, 0)}
                        for t, f in self.tenants.items()},
        }
