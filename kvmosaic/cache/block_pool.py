"""The block pool: reference counts, the content index, a free list and an evictor.

It is also the one source of cache events for both backends: a block enters the content
index only through :meth:`BlockPool.cache_block` (``BlockStored``) and leaves it only through
:meth:`BlockPool.uncache_block` (``BlockRemoved``; counted as an eviction when memory was
needed) or :meth:`BlockPool.reset_prefix_cache` (``AllBlocksCleared``), so a subscriber's
view of the cached hashes equals ``BlockPool.cached`` (tests: test_cache_events.py).

Invariants (docs/ARCHITECTURE.md, invariant 2; checked by :meth:`BlockPool.check_invariants`
and property-tested in test_block_pool.py and test_radix_tree.py):

* every block is in exactly one state: *in use* (``ref_cnt > 0``), *evictable*
  (``ref_cnt == 0`` and it holds a hash, so its KV can still be hit), or *free*
  (``ref_cnt == 0``, no hash); ``free + evictable + in_use == num_blocks``;
* the free queue holds exactly the free blocks and the evictor exactly the evictable ones,
  so a cached block is evicted only when no truly free block is left; among cached blocks
  the evictor's policy picks the victim (LRU by default, O(1); see ``eviction.py``);
* a block's hash is set only after its KV was written (the caller's promise) and cleared
  only when the block is evicted (re-allocated) or the cache is reset;
* a block with a reference is never evicted; a hash maps to at most one block;
* a pinned block holds one reference owned by the pin table (so it is *in use* and never
  evicted); at most ``max_pinned_blocks`` distinct blocks are pinned.

Other owners of references (a radix tree holds one per node covering a block; :meth:`hold`, one
per block until work deferred past a step has read it) are in use as far as the pool knows; they
give blocks back with :meth:`free_blocks`, and drop a block's hash with :meth:`uncache_block` when
its content stops being reachable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

from .block import FreeBlockQueue, KVBlock, NoFreeBlocksError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog
from .eviction import Evictor, make_evictor
from .hashing import BlockHash
from .residency import BlockResidency

__all__ = ["BlockObserver", "BlockPool", "FreeBlockQueue", "KVBlock", "NoFreeBlocksError"]


class BlockObserver(Protocol):
    """Told of every block entering and leaving the content index (both backends)."""

    def on_cache(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                 token_ids: Sequence[int]) -> None: ...

    def on_uncache(self, block: KVBlock, block_hash: BlockHash, evicted: bool) -> None: ...

    def on_hit(self, block: KVBlock) -> None:
        """A request reuses the cached ``block`` (``block.hits`` counts its uses)."""


class BlockPool:
    """Owns every block's reference count and the hash -> block index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog | None = None,
        verify_tokens: bool = False,
        eviction_policy: str = "lru",
        max_pinned_blocks: int | None = None,
        medium: str = "CPU",
        observer: BlockObserver | None = None,
        residency: BlockResidency | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.eviction_policy = eviction_policy
        self.evictor: Evictor = make_evictor(eviction_policy, num_blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events = events or EventLog()
        self.verify_tokens = verify_tokens
        self.medium = medium  # where the pool lives, as KV events name it ("GPU", "CPU")
        self.num_evictions = 0
        self.max_pinned_blocks = num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.pinned: dict[int, int] = {}  # block_id -> pin count
        self._clock = itertools.count(1)
        # Storage tiers (kvmosaic/kv/tiered.py): told when a block enters the index (its KV is
        # written) and when it leaves it (its KV still in the block), so it can copy the KV out
        # (write-through / write-back). None: no tiers, nothing to pay on the hot path. Given at
        # construction (docs/ARCHITECTURE.md, "Storage tiers").
        self.observer: BlockObserver | None = observer
        # The KV layer groups (cache/kv_groups.KVGroup) when the pool serves a hybrid layout,
        # set by its manager (cache/hybrid.py); events name each block's group. None: one group.
        self.groups: tuple | None = None
        # Sampled block lifetimes for vLLM's kv_block_* histograms (residency.py); None: off.
        self.residency: BlockResidency | None = residency

    def set_eviction_policy(self, policy: str) -> None:
        """Switch the evictor; the evictable blocks move over (in the new policy's order)."""
        old, self.evictor = self.evictor, make_evictor(policy, self.num_blocks)
        self.eviction_policy = policy
        for block in sorted(old, key=lambda b: b.last_access):
            self.evictor.add(block)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free plus evictable)."""
        return len(self.free_queue) + len(self.evictor)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int] | None = None
    ) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is not None and self.verify_tokens and token_ids is not None:
            if block.token_ids != tuple(token_ids):
                return None  # a hash collision: treat as a miss, never serve wrong KV
        return block

    # ---- reference counting --------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks, evicting cached ones (in policy order) only when no truly
        free block is left."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if len(self.free_queue):
                block = self.free_queue.popleft()
            else:
                block = self.evictor.pop()
                self._evict(block)
            block.ref_cnt = 1
            block.hits = 1
            block.priority = 0
            block.last_access = next(self._clock)
            if self.residency is not None:
                self.residency.allocated(block.block_id)
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (removing them from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.remove(block)
                else:
                    self.evictor.remove(block)
            block.ref_cnt += 1
            block.hits += 1
            block.last_access = next(self._clock)
            if self.residency is not None:
                self.residency.accessed(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock], priority: int = 0) -> None:
        """Drop one reference from each block. Pass them in eviction order: a request frees
        its blocks tail first, so its last blocks (least likely shared) are evicted first.
        ``priority`` is the dropping request's (see the ``priority`` eviction policy)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            block.priority = max(block.priority, priority)
            block.last_access = next(self._clock)
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.append(block)
                else:
                    self.evictor.add(block)

    def hold(self, blocks: Iterable[KVBlock]) -> None:
        """One more reference on each block in use (its owner's stays), dropped by
        :meth:`free_blocks`: the block keeps its KV after its owner frees it."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} is not in use")
            block.ref_cnt += 1

    # ---- pinning -------------------------------------------------------------------------
    def pin(self, blocks: Sequence[KVBlock]) -> bool:
        """Hold a reference on each block until :meth:`unpin`. All or nothing: refused
        (False) when it would pin more than ``max_pinned_blocks`` distinct blocks."""
        new = {b.block_id for b in blocks} - self.pinned.keys()
        if len(self.pinned) + len(new) > self.max_pinned_blocks:
            return False
        self.touch(blocks)
        for b in blocks:
            self.pinned[b.block_id] = self.pinned.get(b.block_id, 0) + 1
        return True

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        for b in blocks:
            count = self.pinned.get(b.block_id, 0)
            if count == 0:
                raise RuntimeError(f"{b} is not pinned")
            if count == 1:
                del self.pinned[b.block_id]
            else:
                self.pinned[b.block_id] = count - 1
        self.free_blocks(reversed(blocks))

    # ---- the content index ---------------------------------------------------------------
    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        adapter_id: str | None = None,
        group: int = 0,
    ) -> bool:
        """Index a full block whose KV has been written. Returns False (and indexes nothing)
        when another block already holds this hash: the first copy stays canonical.
        ``group``: the KV layer group whose page it is (``self.groups``; events name it)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        if self.verify_tokens:
            block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        block.group = group
        spec = self.groups[group] if self.groups else None
        self.events.emit(
            BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, adapter_id, self.medium,
                        group, spec.kind if spec else "full_attention", spec.window if spec else None)
        )
        if self.observer is not None:
            self.observer.on_cache(block, block_hash, parent_hash, token_ids)
        return True

    def record_hits(self, blocks: Iterable[KVBlock]) -> None:
        """A new request reuses these cached blocks (for policies that count hits)."""
        if self.observer is not None:
            for block in blocks:
                if block.block_hash is not None:
                    self.observer.on_hit(block)

    def uncache_block(self, block: KVBlock, evicted: bool = True) -> None:
        """Take a block out of the content index (its KV stays until it is overwritten).
        ``evicted``: it goes because memory is needed, which the eviction counter counts."""
        if self.observer is not None:  # before the hash goes: the KV is still in the block
            self.observer.on_uncache(block, block.block_hash, evicted)
        del self.cached[block.block_hash]
        self.events.emit(BlockRemoved([block.block_hash], self.medium, block.group))
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += evicted
        if evicted and self.residency is not None:
            self.residency.evicted(block.block_id)

    def _evict(self, block: KVBlock) -> None:
        self.uncache_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and every pin. Refused (returns False) while any block
        is in use other than by a pin, since running requests may be about to index blocks
        they are filling."""
        if self.num_used_blocks > len(self.pinned) or any(
            self.blocks[i].ref_cnt != c for i, c in self.pinned.items()
        ):
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
            block.ref_cnt = 0
        self.pinned.clear()
        self.cached.clear()
        self.free_queue = FreeBlockQueue(self.blocks)
        self.evictor = make_evictor(self.eviction_policy, self.num_blocks)
        self.events.emit(AllBlocksCleared())
        if self.residency is not None:
            self.residency.cleared()
        return True

    def check_invariants(self) -> None:
        in_queue: set[int] = set()
        for b in self.free_queue:
            assert b.ref_cnt == 0, f"{b} is queued with references"
            assert b.block_hash is None, f"{b} is free but holds a hash"
            assert b.block_id not in in_queue, f"{b} is queued twice"
            in_queue.add(b.block_id)
        for b in self.evictor:
            assert b.ref_cnt == 0, f"{b} is evictable with references"
            assert b.block_hash is not None, f"{b} is evictable without a hash"
            assert b.block_id not in in_queue, f"{b} is queued twice"
            in_queue.add(b.block_id)
        assert len(in_queue) == self.num_free_blocks
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"{b} queue state is wrong"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"{b} hash not indexed"
        for i, c in self.pinned.items():
            assert self.blocks[i].ref_cnt >= c > 0, f"pinned {self.blocks[i]} lost its reference"
        assert len(self.pinned) <= self.max_pinned_blocks
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        free = sum(b.ref_cnt == 0 and b.block_hash is None for b in self.blocks)
        evictable = sum(b.ref_cnt == 0 and b.block_hash is not None for b in self.blocks)
        in_use = sum(b.ref_cnt > 0 for b in self.blocks)
        assert free + evictable + in_use == self.num_blocks
        assert free == len(self.free_queue) and evictable == len(self.evictor)
