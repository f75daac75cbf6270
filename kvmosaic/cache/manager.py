"""KV cache managers: the one interface the scheduler talks to, and what its backends share.

A manager maps each running request to its *block table* (the physical blocks that hold
its tokens' KV, in order) and decides which blocks a new request can take from the cache.
The life of a request, as the scheduler drives it::

    match = mgr.match_prefix(req)            # no side effects
    table = mgr.allocate_slots(req, n, match) # takes refs on the hit, allocates new blocks
    ... the model writes KV for the scheduled tokens ...
    mgr.commit(req, num_computed_tokens)      # index what is now computed
    ... more allocate_slots / commit per step ...
    mgr.free(req)                             # drop refs, tail first

A request may also start from another's KV: ``mgr.fork(parent, child, n)`` (parallel
sampling, ``n > 1``) gives ``child`` the parent's first ``n`` computed tokens, sharing its
full blocks and copying the partial last one (copy-on-write).

Backends: ``HashCacheManager`` (vLLM's block hash chain, in ``hash_manager.py``;
``enable_caching=False`` gives the no-cache baseline), ``RadixCacheManager`` (SGLang's radix
tree, in ``radix.py``) and the hybrid layout's (``hybrid.py``). All give identical model
outputs; they differ only in how much they reuse.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .block import KVBlock
from .block_pool import BlockPool
from .hashing import BlockHash, BlockHasher, CacheNamespace, HashFn


class TierLookup(Protocol):
    """Storage tiers below the pool, as a manager sees them (kvmosaic/kv/tiered.py; given to
    the manager's constructor, docs/ARCHITECTURE.md "Storage tiers")."""

    def lookup(self, keys: Sequence[BlockHash]) -> list[int | None]: ...


class CacheRequest(Protocol):
    """What a manager needs to know about a request (the engine's Sequence provides it)."""

    request_id: str
    cache_salt: str | None
    adapter_id: str | None
    priority: int  # higher = kept longer under the "priority" eviction policy
    # Shared-public tenancy: leading blocks hashed without the salt (CacheNamespace). Read with
    # ``getattr(req, "public_blocks", 0)``, so requests that predate it need not define it.
    public_blocks: int

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class PlainRequest:
    """A :class:`CacheRequest` for callers outside the engine (tools, benchmarks)."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    adapter_id: str | None = None
    priority: int = 0
    public_blocks: int = 0


@dataclass
class MatchResult:
    """A cached prefix found for a request: ``blocks`` hold its first ``num_tokens`` tokens.

    ``num_tokens`` may end inside the last block (radix backend); the manager then copies
    that block's matched part into a fresh block before the request writes to it.
    """

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    # Storage tiers: the blocks right after the pool hit that a tier holds, as
    # ``(chain hash, tier index)`` in order (fastest tier holding each). Not loaded yet: the
    # scheduler loads them into fresh blocks; ``num_tokens`` counts the pool hit only.
    tier_hits: list[tuple[BlockHash, int]] = field(default_factory=list)

    def tier_tokens(self, block_size: int) -> dict[int, int]:
        """How many tokens each tier (by index) would supply."""
        out: dict[int, int] = {}
        for _, t in self.tier_hits:
            out[t] = out.get(t, 0) + block_size
        return out


@dataclass(frozen=True)
class BlockCopy:
    """Copy the KV of the first ``num_tokens`` slots of block ``src`` into block ``dst``."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class PinResult:
    """A pinned prefix: ``num_tokens`` tokens in ``num_blocks`` blocks that no eviction
    touches until ``unpin(pin_id)``. ``pin_id`` is None when nothing was pinned (nothing
    cached, or ``refused`` because the pin budget would be exceeded)."""

    pin_id: int | None
    num_tokens: int
    num_blocks: int
    refused: bool = False


@dataclass(frozen=True)
class CacheSizeInfo:
    """Invariant 2 (docs/ARCHITECTURE.md), in blocks: ``free + evictable + in_use == total``;
    stated and checked where it is kept: BlockPool (hash backend), RadixCacheManager (radix)."""

    total: int
    free: int
    evictable: int
    in_use: int
    # Blocks holding KV a later request can hit (in use or evictable); outside the invariant.
    cached: int = field(default=0, compare=False)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager(ABC):
    """The interface the scheduler drives (see the module docstring), and what both backends
    share: block tables, the request's hash chain (both name full blocks by it, so both
    emit the same cache events through the pool), copy-on-write and the query counters."""

    enable_caching = True  # False: the no-cache baseline (nothing is matched or indexed)

    def __init__(self, pool: BlockPool, seed: BlockHash, hash_fn: HashFn, tiers: TierLookup | None = None) -> None:
        self.pool = pool
        self.seed = seed
        self.hash_fn = hash_fn
        self.block_size = pool.block_size
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.hashers: dict[str, BlockHasher] = {}
        self.stats = PrefixCacheStats()
        self.pending_copies: list[BlockCopy] = []
        # Storage tiers below the pool, looked up past a pool miss (``MatchResult.tier_hits``);
        # None: no tiers. Given at construction (LLMEngine builds the connector first).
        self.tiers: TierLookup | None = tiers

    def namespace(self, cache_salt: str | None, adapter_id: str | None, public_blocks: int = 0) -> CacheNamespace:
        return CacheNamespace(self.seed, cache_salt, adapter_id, public_blocks)

    def request_namespace(self, req: CacheRequest) -> CacheNamespace:
        """The namespace a request's KV lives in (salt, adapter and public head included)."""
        return self.namespace(req.cache_salt, req.adapter_id, getattr(req, "public_blocks", 0))

    def new_hasher(self, cache_salt: str | None = None, adapter_id: str | None = None,
                   public_blocks: int = 0) -> BlockHasher:
        return BlockHasher(self.namespace(cache_salt, adapter_id, public_blocks), self.block_size, self.hash_fn)

    def hasher(self, req: CacheRequest) -> BlockHasher:
        """The request's hash chain, extended incrementally as its tokens grow."""
        h = self.hashers.get(req.request_id)
        if h is None:
            h = self.hashers[req.request_id] = BlockHasher(self.request_namespace(req), self.block_size, self.hash_fn)
        return h

    # ---- the cache policy (per backend) --------------------------------------------------
    @abstractmethod
    def match_prefix(self, req: CacheRequest) -> MatchResult:
        """The longest reusable prefix, at most ``len(tokens) - 1`` tokens (the last prompt
        token is always recomputed: its logits are needed). No side effects."""

    @abstractmethod
    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Make the request's first ``num_computed_tokens`` tokens (KV written) reusable."""

    def on_free(self, req: CacheRequest, blocks: list[KVBlock]) -> None:
        """Hook for backends that keep per-request state."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, adapter_id: str | None = None
    ) -> PinResult:
        """Keep the cached part of this prefix from eviction (bounded by the pool's
        ``max_pinned_blocks``)."""

    @abstractmethod
    def unpin(self, pin_id: int) -> None: ...

    @abstractmethod
    def size_info(self) -> CacheSizeInfo: ...

    # ---- shared mechanics ----------------------------------------------------------------
    def tier_hits(self, hashes: Sequence[BlockHash], start: int, stop: int) -> list[tuple[BlockHash, int]]:
        """The longest contiguous run of ``hashes[start:stop]`` the tiers hold (fastest first)."""
        if self.tiers is None or start >= stop:
            return []
        out = []
        for h, t in zip(hashes[start:stop], self.tiers.lookup(hashes[start:stop])):
            if t is None:
                break
            out.append((h, t))
        return out

    def record_query(self, req: CacheRequest, match: MatchResult) -> None:
        self.stats.requests += 1
        self.stats.queries += len(req.all_token_ids)
        self.stats.hits += match.num_tokens

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One table per KV layer group (``cache/kv_groups.py``): here the one group."""
        return [self.block_table(request_id)]

    def num_blocks_needed(self, req: CacheRequest, num_tokens: int, match: MatchResult | None) -> int:
        have = len(self.req_blocks.get(req.request_id, ()))
        if match is not None and req.request_id not in self.req_blocks:
            have = match.num_tokens // self.block_size  # whole hit blocks are shared
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(
        self, req: CacheRequest, num_total_tokens: int, match: MatchResult | None = None
    ) -> list[int] | None:
        """Make the block table cover ``num_total_tokens`` tokens. On the request's first
        call, ``match`` is the prefix to reuse (its blocks are referenced). Returns the block
        table, or None, changing nothing, when the pool cannot supply the blocks."""
        first = req.request_id not in self.req_blocks
        hit = match if (first and match is not None) else MatchResult()
        full_hit = hit.num_tokens // self.block_size
        partial = hit.num_tokens % self.block_size
        need = self.num_blocks_needed(req, num_total_tokens, hit if first else None)
        # Hit blocks that are evictable leave the free queue when touched: count them.
        evictable_hits = sum(1 for b in hit.blocks[:full_hit] if b.ref_cnt == 0)
        if need + evictable_hits > self.pool.num_free_blocks:
            return None
        if first:
            self.pool.touch(hit.blocks[:full_hit])
            self.pool.record_hits(hit.blocks[:full_hit])
            self.req_blocks[req.request_id] = list(hit.blocks[:full_hit])
        new = self.pool.get_new_blocks(need)
        if first and partial:
            # Copy-on-write: the matched head of a shared block goes into a private block.
            self.pending_copies.append(BlockCopy(hit.blocks[full_hit].block_id, new[0].block_id, partial))
        self.req_blocks[req.request_id].extend(new)
        return self.block_table(req.request_id)

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> bool:
        """Give ``child`` (new to the manager, whose first ``num_tokens`` tokens are the
        parent's) the KV of the parent's first ``num_tokens`` tokens, computed already: the full
        blocks are shared (one reference each, so invariant 2 holds as for any hit) and the
        partial last block is copied into a fresh block (a :class:`BlockCopy`, run before the
        next forward pass), so neither request ever writes into a block the other reads.
        Counted as a prefix-cache query that hit all ``num_tokens``. Returns False, changing
        nothing, when no block is free for the copy."""
        if child.request_id in self.req_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self.req_blocks[parent.request_id]
        full, partial = divmod(num_tokens, self.block_size)
        if len(blocks) < full + (1 if partial else 0):
            raise ValueError(f"request {parent.request_id!r} holds no KV for {num_tokens} tokens")
        if partial and not self.make_room(1):
            return False
        shared = blocks[:full]
        self.pool.touch(shared)
        new = self.pool.get_new_blocks(1) if partial else []
        if partial:
            self.pending_copies.append(BlockCopy(blocks[full].block_id, new[0].block_id, partial))
        self.req_blocks[child.request_id] = list(shared) + new
        self.stats.requests += 1
        self.stats.queries += num_tokens
        self.stats.hits += num_tokens
        self.on_fork(parent, child, num_tokens)
        return True

    def make_room(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` can be taken from the pool now (backends whose cache holds
        references, such as the radix tree, evict to make them so)."""
        return self.pool.num_free_blocks >= num_blocks

    def on_fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        """Hook for backends that keep per-request state: ``child`` was just forked."""

    def take_pending_copies(self) -> list[BlockCopy]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def hold(self, request_id: str) -> list[KVBlock]:
        """One more reference on each block of the request's table, so that their KV stays where it
        is after the request frees them, until :meth:`release`: work on a request's KV deferred past
        its step (automatic reuse's stores, blend/engine_hook.py)."""
        blocks = list(self.req_blocks.get(request_id, ()))
        self.pool.hold(blocks)
        return blocks

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop the references :meth:`hold` took (tail first, as a request frees its blocks)."""
        self.pool.free_blocks(reversed(blocks))

    def free(self, req: CacheRequest) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.hashers.pop(req.request_id, None)
        self.on_free(req, blocks)
        self.pool.free_blocks(reversed(blocks), getattr(req, "priority", 0))


class PooledPins:
    """Pins and sizes for a manager whose cached blocks live in its :class:`BlockPool` (the hash
    chain, the hybrid layout): a pin holds its blocks' references until :meth:`unpin`."""

    pool: BlockPool

    def __init__(self) -> None:
        self.pins: dict[int, list[KVBlock]] = {}
        self._pin_ids = itertools.count(1)

    def _pin_blocks(self, blocks: list[KVBlock], num_tokens: int) -> PinResult:
        if not blocks:
            return PinResult(None, 0, 0)
        if not self.pool.pin(blocks):
            return PinResult(None, 0, 0, refused=True)
        pin_id = next(self._pin_ids)
        self.pins[pin_id] = blocks
        return PinResult(pin_id, num_tokens, len(blocks))

    def unpin(self, pin_id: int) -> None:
        self.pool.unpin(self.pins.pop(pin_id))

    def size_info(self) -> CacheSizeInfo:
        free, evictable = len(self.pool.free_queue), len(self.pool.evictor)
        return CacheSizeInfo(self.pool.num_blocks, free, evictable, self.pool.num_blocks - free - evictable,
                             len(self.pool.cached))
