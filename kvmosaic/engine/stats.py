"""What the engine reports about itself: :class:`EngineStats` (a snapshot for metrics and
``/health``, taken by :func:`engine_stats`) and :class:`ModelInfo` (what names its KV).
docs/ARCHITECTURE.md, "Layers"."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int  # prompt tokens not computed yet, waiting and running (router load)
    num_preemptions: int
    num_evictions: int
    prompt_tokens: int
    generation_tokens: int
    kv_bytes_per_token: int
    num_events_dropped: int = 0
    kv_slots_allocated: int = 0  # slots of the blocks running requests hold
    kv_slots_used: int = 0  # of those, slots holding a computed token
    # Storage tiers: per tier (by name) counters, medium, policy, state, bytes; {} when off.
    kv_tiers: dict = field(default_factory=dict)
    # Live miss reasons and per-tenant figures (CacheLens.snapshot); {} when off.
    lens: dict = field(default_factory=dict)
    # Sampled KV block residency histograms (cache/residency.py); {} when off.
    kv_residency: dict = field(default_factory=dict)
    # Automatic segment reuse (blend/auto.py): requests answered from reused chunks, tokens
    # reused, guard fallbacks, guard repairs (requests; reused tokens recomputed beyond the ratio).
    auto_reuse_requests: int = 0
    auto_reuse_tokens: int = 0
    auto_reuse_fallbacks: int = 0
    auto_reuse_repairs: int = 0
    auto_reuse_repaired_tokens: int = 0
    # The shadow audit (blend/shadow.py): answers from reused KV measured against a full prefill, those
    # whose KL was over the bound, audits that failed, seconds spent auditing, and the KL's histogram
    # (``buckets`` upper bounds, ``counts`` per bucket with +Inf last, ``sum``; {} before any audit).
    auto_reuse_audits: int = 0
    auto_reuse_audits_over_bound: int = 0
    auto_reuse_audits_failed: int = 0
    auto_reuse_audits_skipped: int = 0  # drawn while shadow.MAX_IN_FLIGHT audits were open
    auto_reuse_audit_seconds: float = 0.0
    auto_reuse_audited_tokens: int = 0  # answer tokens the audits covered (--auto-reuse-audit-tokens each, at most)
    auto_reuse_audit_kl: dict = field(default_factory=dict)
    auto_reuse_audit_tenants: dict = field(default_factory=dict)  # tenant label -> {"audits", "over_bound"}
    # The breaker (blend/breaker.py): namespaces it turned automatic reuse off for, ever and now.
    auto_reuse_audit_trips: int = 0
    auto_reuse_namespaces_off: int = 0
    num_waiting_for_kv: int = 0  # requests parked while a storage tier loads their KV (WAITING_FOR_KV)
    # Anticipation (engine/anticipation.py): idle periods of one-request-at-a-time tenants the
    # next step was held for, how many of those tenants came back inside the hold, seconds held.
    anticipation_holds: int = 0
    anticipation_hits: int = 0
    anticipation_held_seconds: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What a client, a router or a storage tier must know to name this engine's KV: the
    block hash seed is derived from ``fingerprint``, ``dtype``, ``block_size`` and
    ``hash_algo`` (see cache/hashing.py)."""

    name: str
    fingerprint: str
    dtype: str
    block_size: int
    hash_algo: str
    max_model_len: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    seed: bytes
    prefix_cache: str
    quantization: str | None = None  # weight-only quantization (model/quant.py); in ``fingerprint`` too


def engine_stats(engine) -> EngineStats:
    """A snapshot of ``engine`` (an ``LLMEngine``), taken between two steps."""
    st, size = engine.cache.stats, engine.cache.size_info()
    return EngineStats(
        prefix_cache_queries=st.queries,
        prefix_cache_hits=st.hits,
        prefix_cache_hit_rate=st.hit_rate,
        kv_cache_usage=size.in_use / size.total,
        num_blocks=size.total,
        num_free_blocks=size.free + size.evictable,
        num_cached_blocks=size.cached,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_waiting_for_kv=len(engine.scheduler.loading),
        num_queued_prefill_tokens=sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                      for s in (*engine.scheduler.waiting, *engine.scheduler.running)),
        num_preemptions=engine.num_preemptions,
        num_evictions=engine.pool.num_evictions,
        prompt_tokens=engine.prompt_tokens,
        generation_tokens=engine.generation_tokens,
        kv_bytes_per_token=engine.kv.bytes_per_token,
        num_events_dropped=engine.events.num_dropped,
        kv_tiers=engine.tiers.stats() if engine.tiers is not None else {},
        lens=engine.lens.snapshot(engine.scheduler.running) if engine.lens is not None else {},
        kv_residency=engine.pool.residency.snapshot() if engine.pool.residency is not None else {},
        **auto_reuse_stats(engine.segment_reuse.auto_stats),
        **audit_stats(engine.segment_reuse.audit.stats),
        auto_reuse_audit_trips=engine.segment_reuse.breaker.trips,
        auto_reuse_namespaces_off=engine.segment_reuse.breaker.num_off,
        **slot_usage(engine),
        anticipation_holds=engine.scheduler.anticipation.holds,
        anticipation_hits=engine.scheduler.anticipation.hits,
        anticipation_held_seconds=engine.scheduler.anticipation.held_seconds,
    )


def auto_reuse_stats(st) -> dict[str, int]:
    """Automatic segment reuse's counters (blend/auto.py), or {} when it is off."""
    if st is None:
        return {}
    return {"auto_reuse_requests": st.requests, "auto_reuse_tokens": st.tokens,
            "auto_reuse_fallbacks": st.fallbacks, "auto_reuse_repairs": st.repairs,
            "auto_reuse_repaired_tokens": st.repaired_tokens}


def audit_stats(st) -> dict:
    """The shadow audit's counters and KL histogram (blend/shadow.py); {} before any audit."""
    if not st.audits and not st.failed and not st.skipped:
        return {}
    return {"auto_reuse_audits": st.audits, "auto_reuse_audits_over_bound": st.over_bound,
            "auto_reuse_audits_failed": st.failed, "auto_reuse_audits_skipped": st.skipped,
            "auto_reuse_audit_seconds": st.seconds,
            "auto_reuse_audited_tokens": st.tokens,
            "auto_reuse_audit_kl": {"buckets": list(st.buckets), "counts": list(st.kl_counts), "sum": st.kl_sum},
            "auto_reuse_audit_tenants": {t: {"audits": a, "over_bound": o} for t, (a, o) in st.tenants.items()}}


def slot_usage(engine) -> dict[str, int]:
    """Slots of the blocks running requests hold, and how many hold a computed token (a
    shared block counts once, at its fullest): the pool's utilisation under load."""
    bs, filled = engine.pool.block_size, {}
    for seq in engine.scheduler.running:
        held = (engine.cache.held_pages(seq.request_id) if engine.kv_layout.hybrid
                else enumerate(engine.cache.block_table(seq.request_id)))
        for i, bid in held:
            filled[bid] = max(filled.get(bid, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
    return {"kv_slots_allocated": len(filled) * bs, "kv_slots_used": sum(filled.values())}
