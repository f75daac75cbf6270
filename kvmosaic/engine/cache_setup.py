"""The engine's prefix cache, built from its config: the KV layout (full, or hybrid for
sliding-window models) and the backend (vLLM's hash chain, SGLang's radix tree, the per-group
hybrid). docs/ARCHITECTURE.md, "Hybrid KV layout"."""

from __future__ import annotations

import logging

from ..cache.block_pool import BlockPool
from ..cache.hash_manager import HashCacheManager
from ..cache.hashing import get_hash_fn
from ..cache.hybrid import HybridCacheManager
from ..cache.kv_groups import KVLayout
from ..cache.manager import KVCacheManager, TierLookup
from .config import EngineConfig

logger = logging.getLogger("kvmosaic.engine")


def kv_layout_for(config: EngineConfig, windows: list[int | None]) -> KVLayout:
    """The hybrid layout (``cache/kv_groups.py``) where the model has sliding-window layers and
    ``--kv-layout auto``; the classic one otherwise, and (logged) with the radix backend or
    storage tiers, which keep every block (docs/ARCHITECTURE.md, "Hybrid KV layout")."""
    layout = KVLayout.plan(windows)
    if not layout.hybrid or config.kv_layout == "full":
        return KVLayout.full(len(windows))
    if config.prefix_cache == "radix" or config.kv_tiers:
        logger.info("sliding-window layers keep the whole context's KV: the hybrid KV layout needs the hash "
                    "prefix cache (or none) and no storage tiers")
        return KVLayout.full(len(windows))
    return layout


def make_cache_manager(config: EngineConfig, pool: BlockPool, seed: bytes,
                       tiers: TierLookup | None = None, layout: KVLayout | None = None) -> KVCacheManager:
    """The configured backend; ``tiers``: storage tiers looked up past a pool miss; ``layout``:
    a hybrid KV layout gets the per-group hash backend (``cache/hybrid.py``)."""
    hash_fn = get_hash_fn(config.hash_algo)
    pool.set_eviction_policy(config.eviction_policy)
    if layout is not None and layout.hybrid:
        return HybridCacheManager(pool, seed, hash_fn, layout, enable_caching=config.prefix_cache == "hash")
    if config.prefix_cache == "radix":
        from ..cache.radix import RadixCacheManager

        return RadixCacheManager(pool, seed, eviction_policy=config.eviction_policy, hash_fn=hash_fn, tiers=tiers)
    return HashCacheManager(pool, seed, hash_fn, enable_caching=config.prefix_cache == "hash", tiers=tiers)
