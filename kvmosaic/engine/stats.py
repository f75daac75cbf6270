"""What the engine reports about itself: :class:`EngineStats` (a snapshot for metrics and
``/health``) and :class:`ModelInfo` (what names its KV). docs/ARCHITECTURE.md, "Layers"."""

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
