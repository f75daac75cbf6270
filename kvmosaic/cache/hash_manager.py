"""vLLM's automatic prefix caching as a :class:`~kvmosaic.cache.manager.KVCacheManager`: full
blocks named by the chained hash of their tokens (``hashing.py``), looked up block by block from
the first until the first miss, indexed as they are computed, evicted least recently used by the
pool (``block_pool.py``). ``enable_caching=False`` is the no-cache baseline: the same allocation,
nothing indexed or found. docs/ARCHITECTURE.md, "Prefix caching".
"""

from __future__ import annotations

from collections.abc import Sequence

from .block import KVBlock
from .block_pool import BlockPool
from .hashing import BlockHash, HashFn
from .manager import CacheRequest, KVCacheManager, MatchResult, PinResult, PooledPins, TierLookup


class HashCacheManager(PooledPins, KVCacheManager):
    """vLLM's automatic prefix caching: full blocks named by the chained hash."""

    def __init__(
        self,
        pool: BlockPool,
        seed: BlockHash,
        hash_fn: HashFn,
        enable_caching: bool = True,
        tiers: TierLookup | None = None,
    ) -> None:
        KVCacheManager.__init__(self, pool, seed, hash_fn, tiers)
        PooledPins.__init__(self)
        self.enable_caching = enable_caching
        self.num_committed: dict[str, int] = {}  # blocks already indexed, per request

    def match_prefix(self, req: CacheRequest) -> MatchResult:
        if not self.enable_caching:
            return MatchResult()
        tokens = req.all_token_ids
        hashes = self.hasher(req).update(tokens)
        max_blocks = (len(tokens) - 1) // self.block_size
        bs = self.block_size
        hit: list[KVBlock] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.get_cached_block(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break  # the chain is broken: nothing after a miss can hit
            hit.append(block)
        return MatchResult(hit, len(hit) * bs, self.tier_hits(hashes, len(hit), max_blocks))

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        blocks = self.req_blocks[req.request_id]
        tokens = req.all_token_ids
        hashes = self.hasher(req).update(tokens, num_computed_tokens)
        start = self.num_committed.get(req.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(blocks))
        bs = self.block_size
        for i in range(start, end):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(blocks[i], hashes[i], parent, tokens[i * bs : (i + 1) * bs], req.adapter_id)
        self.num_committed[req.request_id] = max(start, end)

    def on_free(self, req: CacheRequest, blocks: list[KVBlock]) -> None:
        self.num_committed.pop(req.request_id, None)

    def on_fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        # The shared full blocks are indexed already (by the parent): the child goes on after them.
        self.num_committed[child.request_id] = min(self.num_committed.get(parent.request_id, 0),
                                                   num_tokens // self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (and pin); refused while any request runs."""
        if self.req_blocks or not self.pool.reset_prefix_cache():
            return False
        self.pins.clear()
        return True

    def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, adapter_id: str | None = None
    ) -> PinResult:
        if not self.enable_caching:
            return PinResult(None, 0, 0)
        hasher = self.new_hasher(cache_salt, adapter_id)
        bs = self.block_size
        blocks: list[KVBlock] = []
        for i, h in enumerate(hasher.update(token_ids)):
            block = self.pool.get_cached_block(h, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        return self._pin_blocks(blocks, len(blocks) * bs)
