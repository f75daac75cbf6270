"""The radix-tree backend: SGLang's RadixAttention behind the :class:`KVCacheManager` interface.

Matches end at any token, not only at block boundaries. A match that ends inside a block
reuses the whole blocks before it and copies the matched head of the partial block into a
fresh block (copy-on-write, queued as a :class:`BlockCopy`), unless fewer than
``min_cow_tokens`` tokens would be copied (then recomputing them is cheaper).

Accounting (docs/ARCHITECTURE.md, invariant 2): tree nodes hold pool references, so a cached block
is *in use* for the pool; :meth:`RadixCacheManager.size_info` sorts blocks into free (no
reference), evictable (every reference is held by an unlocked tree node) and in use (held
by a request, or by a locked or pinned node): ``free + evictable + in_use == total``. When
the pool is short, unlocked leaves are evicted before any allocation fails.

Per running request the manager keeps one lock on the deepest node its committed tokens
reach (``anchors``); commits walk on from that node's parent, so every step, decode steps
included, makes the generated tokens reusable (turn 2 of a chat reuses turn 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .block_pool import BlockPool
from .hashing import DEFAULT_HASH_ALGO, BlockHash, HashFn, get_hash_fn
from .manager import CacheRequest, CacheSizeInfo, KVCacheManager, MatchResult, PinResult, TierLookup
from .radix_tree import RadixNode, RadixTree

# Below this many tokens a partial block is recomputed rather than copied. Measured with
# ``python -m benchmarks.radix_figures --only cow`` (float32, 2 shared CPU cores): one
# block copy (30 layers) takes ~0.1 ms, one more prefill token ~3-60 ms, so copying pays
# from the first token. Raise it where a copy is dear relative to compute (e.g. a KV pool
# in a slower tier).
DEFAULT_MIN_COW_TOKENS = 1


@dataclass
class _Anchor:
    """A running request's lock: ``node`` (None before anything is in the tree) is the
    deepest node reached by its first ``committed`` tokens, which the tree holds."""

    node: RadixNode | None
    committed: int


@dataclass
class RadixMatch(MatchResult):
    """A :class:`MatchResult` that also names the tree node to lock while it is used."""

    node: RadixNode | None = None


class RadixCacheManager(KVCacheManager):
    def __init__(
        self,
        pool: BlockPool,
        seed: BlockHash,
        eviction_policy: str = "lru",
        min_cow_tokens: int = DEFAULT_MIN_COW_TOKENS,
        hash_fn: HashFn | None = None,
        tiers: TierLookup | None = None,
    ) -> None:
        super().__init__(pool, seed, hash_fn or get_hash_fn(DEFAULT_HASH_ALGO), tiers)
        self.tree = RadixTree(pool, eviction_policy)
        self.min_cow_tokens = max(1, min_cow_tokens)
        self.anchors: dict[str, _Anchor] = {}
        self.pins: dict[int, RadixNode] = {}
        self.pinned_tokens: dict[int, int] = {}
        self._pin_ids = itertools.count(1)
        self.num_cow_copies = 0
        self.num_cow_tokens = 0

    # ---- the cache policy ----------------------------------------------------------------
    def match_prefix(self, req: CacheRequest) -> RadixMatch:
        tokens = req.all_token_ids
        ns = self.request_namespace(req)
        tm = self.tree.match(ns, tokens[: len(tokens) - 1])
        if ns.public_blocks:
            # Shared-public tenancy: the public head is also found in the unsalted tree, but
            # a match there stops at the public boundary (never into another tenant's tail).
            head = min(ns.public_blocks * self.block_size, len(tokens) - 1)
            pm = self.tree.match(ns.public(), tokens[:head])
            if pm.num_tokens > tm.num_tokens:
                tm = pm
        n, blocks = tm.num_tokens, tm.blocks
        partial = n % self.block_size
        if 0 < partial < self.min_cow_tokens:
            n -= partial
            blocks = blocks[:-1]
        tier_hits: list = []
        if self.tiers is not None:
            # Past the tree, the storage tiers, keyed by the chain hashes of the following full
            # blocks; a tier block replaces a partial tail match (it holds the whole block).
            hashes = self.hasher(req).update(tokens)
            tier_hits = self.tier_hits(hashes, n // self.block_size, (len(tokens) - 1) // self.block_size)
            if tier_hits and n % self.block_size:
                n -= n % self.block_size
                blocks = blocks[:-1]
        return RadixMatch(blocks, n, tier_hits, node=tm.node if n else None)

    def allocate_slots(
        self, req: CacheRequest, num_total_tokens: int, match: MatchResult | None = None
    ) -> list[int] | None:
        rid = req.request_id
        first = rid not in self.req_blocks
        if first and match is not None and match.num_tokens and not isinstance(match, RadixMatch):
            raise TypeError("a radix hit must come from RadixCacheManager.match_prefix (it names the node to lock)")
        node = match.node if first and isinstance(match, RadixMatch) else None
        if node is not None:
            self.tree.lock(node)  # before evicting: the match must survive the eviction
        need = self.num_blocks_needed(req, num_total_tokens, match if first else None)
        if need > self.pool.num_free_blocks:
            self.tree.evict(need - self.pool.num_free_blocks)
        table = super().allocate_slots(req, num_total_tokens, match)
        if not first:
            return table
        if table is None:
            if node is not None:
                self.tree.unlock(node)
            return None
        self.anchors[rid] = _Anchor(node, match.num_tokens if node is not None else 0)
        if node is not None:
            self.tree.touch_path(node, getattr(req, "priority", 0))
        if match is not None and match.num_tokens % self.block_size:
            self.num_cow_copies += 1
            self.num_cow_tokens += match.num_tokens % self.block_size
        return table

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        rid = req.request_id
        state = self.anchors[rid]
        if num_computed_tokens <= state.committed:
            return
        ns = self.request_namespace(req)
        tokens = req.all_token_ids[:num_computed_tokens]
        anchor = state.node
        start = anchor.parent if anchor is not None and anchor.namespace == ns else None
        # The anchor may reach past the committed tokens, and a split since the last commit
        # may have moved them above its parent: walk up until the path is theirs alone.
        while start is not None and start.end > state.committed:
            start = start.parent
        hashes = self.hasher(req).update(tokens)
        node = self.tree.insert(ns, tokens, self.req_blocks[rid], start, anchor, getattr(req, "priority", 0), hashes)
        head = ns.public_blocks * self.block_size
        if head and state.committed < head <= num_computed_tokens:
            # The public head also goes to the unsalted tree (its blocks are shared by both
            # trees' nodes, reference-counted), where other tenants' matches find it.
            self.tree.insert(ns.public(), tokens[:head], self.req_blocks[rid], None, None,
                             getattr(req, "priority", 0), hashes[: ns.public_blocks])
        if node is not anchor:
            self.tree.lock(node)
            if anchor is not None:
                self.tree.unlock(anchor)
        self.anchors[rid] = _Anchor(node, num_computed_tokens)

    def make_room(self, num_blocks: int) -> bool:
        if num_blocks > self.pool.num_free_blocks:
            self.tree.evict(num_blocks - self.pool.num_free_blocks)
        return self.pool.num_free_blocks >= num_blocks

    def on_fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        # The child holds its own lock on the parent's anchor (the tree holds the same tokens).
        state = self.anchors[parent.request_id]
        if state.node is not None:
            self.tree.lock(state.node)
        self.anchors[child.request_id] = _Anchor(state.node, min(state.committed, num_tokens))

    def on_free(self, req: CacheRequest, blocks: list) -> None:
        state = self.anchors.pop(req.request_id, None)
        if state is not None and state.node is not None:
            # The whole path was in use until now (as a hash backend's blocks are, freed
            # tail first): without this, a shared prompt would look older than its tails.
            self.tree.touch_path(state.node, getattr(req, "priority", 0), hit=False)
            self.tree.unlock(state.node)

    def reset_prefix_cache(self) -> bool:
        """Drop the whole tree (and every pin). Refused while any request runs."""
        if self.req_blocks or self.anchors:
            return False
        for pin_id in list(self.pins):
            self.unpin(pin_id)
        return self.tree.clear() and self.pool.reset_prefix_cache()

    # ---- pinning -------------------------------------------------------------------------
    def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, adapter_id: str | None = None
    ) -> PinResult:
        """Lock the cached part of the prefix. The budget is the pool's, in tokens:
        ``max_pinned_blocks * block_size``, counting each pin in full (overlaps included)."""
        tm = self.tree.match(self.namespace(cache_salt, adapter_id), token_ids)
        if tm.node is None or tm.num_tokens == 0:
            return PinResult(None, 0, 0)
        budget = self.pool.max_pinned_blocks * self.block_size
        if sum(self.pinned_tokens.values()) + tm.num_tokens > budget:
            return PinResult(None, 0, 0, refused=True)
        pin_id = next(self._pin_ids)
        self.tree.lock(tm.node)
        self.pins[pin_id] = tm.node
        self.pinned_tokens[pin_id] = tm.num_tokens
        return PinResult(pin_id, tm.num_tokens, len(tm.blocks))

    def unpin(self, pin_id: int) -> None:
        self.tree.unlock(self.pins.pop(pin_id))
        del self.pinned_tokens[pin_id]

    # ---- accounting ----------------------------------------------------------------------
    def size_info(self) -> CacheSizeInfo:
        refs, locked = self.tree.block_refs()
        free = evictable = 0
        for b in self.pool.blocks:
            if b.ref_cnt == 0:
                free += 1
            elif refs.get(b.block_id, 0) == b.ref_cnt and b.block_id not in locked:
                evictable += 1
        total = self.pool.num_blocks
        return CacheSizeInfo(total, free, evictable, total - free - evictable, len(refs))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.tree.check_invariants()
        for rid, state in self.anchors.items():
            assert rid in self.req_blocks, f"{rid} holds a lock but no blocks"
            assert state.node is None or state.node.lock_ref > 0
