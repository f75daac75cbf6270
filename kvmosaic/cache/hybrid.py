"""The hash-chain backend over a hybrid layout: one block table per layer group, windows given back.

The groups (``cache/kv_groups.py``) share one :class:`BlockPool` of equal pages, so
invariant 2 (docs/ARCHITECTURE.md) is the pool's, unchanged: every page is free, evictable or
in use, whichever group it serves. Per request each group has its own block table, indexed by
the same logical block (block ``i`` holds tokens ``i*B .. i*B+B-1`` in every group):

* a full-attention group's table is the classic one;
* a sliding-window group's entries before ``KVLayout.first_live_block`` are ``None``: their
  pages were given back (a reference dropped; committed pages stay evictable, hittable) when
  the request's computed tokens moved past them, before new pages are allocated
  (``allocate_slots``, as vLLM's ``SlidingWindowManager.remove_skipped_blocks``). A running
  sequence of an all-windowed model thus holds ``ceil(W / B) + 1`` pages per group, plus the
  chunk being computed;
* a page is named in the pool's content index by the block's chain hash, with the group's
  index appended for groups past 0 (vLLM's ``BlockHashWithGroupId``), so groups never share a
  page and group 0 publishes the plain chain hash that routers compute.

A prefix hit of ``h`` blocks needs blocks ``0 .. h-1`` in every full group and, in every
window group, only the blocks a query at position ``h*B`` can see (``first_live_block(h*B) ..
h-1``): :meth:`match_prefix` takes the longest such ``h`` (vLLM's
``find_longest_cache_hit`` for sliding windows), so a windowed model's hits are not zero
when its early blocks were given back (vllm#51250).

The block table the runner reads for a window group names page 0 in place of a given-back
block: no query reads or writes those slots (``model/window.py`` cuts every windowed
context to its window), so no reference is held for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .block import KVBlock
from .block_pool import BlockPool
from .hashing import BlockHash, HashFn
from .kv_groups import KVLayout
from .manager import BlockCopy, CacheRequest, KVCacheManager, MatchResult, PinResult, PlainRequest, PooledPins

Table = list[KVBlock | None]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The content-index key of a block's page in ``group``."""
    return block_hash if group == 0 else block_hash + bytes([group])


@dataclass
class HybridMatch(MatchResult):
    """A hit of ``num_tokens`` (whole blocks): ``group_blocks[g]`` is group ``g``'s table for
    them, ``None`` where a window group needs no page. ``blocks`` is group 0's."""

    group_blocks: list[Table] = field(default_factory=list)


class HybridCacheManager(PooledPins, KVCacheManager):
    """:class:`~.hash_manager.HashCacheManager`'s policy, per layer group (see the module docstring)."""

    def __init__(self, pool: BlockPool, seed: BlockHash, hash_fn: HashFn, layout: KVLayout,
                 enable_caching: bool = True) -> None:
        KVCacheManager.__init__(self, pool, seed, hash_fn, None)
        PooledPins.__init__(self)
        self.layout = layout
        pool.groups = layout.groups
        self.enable_caching = enable_caching
        self.tables: dict[str, list[Table]] = {}
        self.num_committed: dict[str, list[int]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    # ---- lookup --------------------------------------------------------------------------
    def _cached(self, hashes: Sequence[BlockHash], tokens: Sequence[int], i: int, g: int) -> KVBlock | None:
        bs = self.block_size
        return self.pool.get_cached_block(group_key(hashes[i], g), tokens[i * bs : (i + 1) * bs])

    def match_prefix(self, req: CacheRequest) -> MatchResult:
        if not self.enable_caching:
            return MatchResult()
        tokens = req.all_token_ids
        hashes = self.hasher(req).update(tokens)
        n = (len(tokens) - 1) // self.block_size
        groups = range(self.num_groups)
        full = [g for g in groups if self.layout.groups[g].window is None]
        windowed = [g for g in groups if self.layout.groups[g].window is not None]
        for g in full:  # the chain from block 0: nothing after a miss can hit
            i = 0
            while i < n and self._cached(hashes, tokens, i, g) is not None:
                i += 1
            n = i
        # Window groups: the longest h <= n whose last blocks (those a query at h*B sees) are
        # cached in every window group; run[i] counts the cached blocks ending at block i.
        run, r = [], 0
        for i in range(n):
            r = r + 1 if all(self._cached(hashes, tokens, i, g) is not None for g in windowed) else 0
            run.append(r)
        h = n
        while h > 0:
            lo = max((self.layout.first_live_block(g, h * self.block_size, self.block_size) for g in windowed), default=0)
            if run[h - 1] >= h - lo:
                break
            h -= 1
        tables = []
        for g in groups:
            lo = self.layout.first_live_block(g, h * self.block_size, self.block_size)
            tables.append([None] * lo + [self._cached(hashes, tokens, i, g) for i in range(lo, h)])
        return HybridMatch(list(tables[0]), h * self.block_size, [], tables)

    # ---- allocation ----------------------------------------------------------------------
    def release_outside_window(self, req: CacheRequest, num_computed: int) -> int:
        """Give back the window groups' pages that no query from ``num_computed`` on sees;
        returns how many references were dropped."""
        tables = self.tables.get(req.request_id)
        if tables is None:
            return 0
        out = []
        for g, table in enumerate(tables):
            lo = min(self.layout.first_live_block(g, num_computed, self.block_size), len(table))
            for i in range(lo):
                if table[i] is not None:
                    out.append(table[i])
                    table[i] = None
        self.pool.free_blocks(out, getattr(req, "priority", 0))
        return len(out)

    def num_blocks_needed(self, req: CacheRequest, num_tokens: int, match: MatchResult | None) -> int:
        """Every group's blocks short of ``num_tokens`` (a window group's given-back entries count as held)."""
        tables = self.tables.get(req.request_id)
        if tables is None:
            hit = match if isinstance(match, HybridMatch) and match.group_blocks else None
            tables = hit.group_blocks if hit else [[] for _ in range(self.num_groups)]
        nblocks = -(-num_tokens // self.block_size)
        return sum(max(0, nblocks - len(t)) for t in tables)

    def allocate_slots(self, req: CacheRequest, num_total_tokens: int,
                       match: MatchResult | None = None) -> list[int] | None:
        rid = req.request_id
        first = rid not in self.tables
        if first:
            hit = match if isinstance(match, HybridMatch) and match.group_blocks else None
            tables = [list(t) for t in hit.group_blocks] if hit else [[] for _ in range(self.num_groups)]
            hit_blocks = [b for t in tables for b in t if b is not None]
        else:
            computed = getattr(req, "num_computed_tokens", None)
            if computed is not None:
                self.release_outside_window(req, computed)
            tables, hit_blocks = self.tables[rid], []
        nblocks = -(-num_total_tokens // self.block_size)
        need = self.num_blocks_needed(req, num_total_tokens, match)
        if need + sum(1 for b in hit_blocks if b.ref_cnt == 0) > self.pool.num_free_blocks:
            return None
        if first:
            self.pool.touch(hit_blocks)
            self.pool.record_hits(hit_blocks)
            self.tables[rid] = tables
            self.num_committed[rid] = [len(t) for t in tables]
        for table in tables:
            if len(table) < nblocks:
                table.extend(self.pool.get_new_blocks(nblocks - len(table)))
        return self.block_table(rid)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Each group's table as page ids (page 0 where a window group gave a block back)."""
        return [[0 if b is None else b.block_id for b in t] for t in self.tables.get(request_id, ())]

    def block_table(self, request_id: str) -> list[int]:
        tables = self.block_tables(request_id)
        return tables[0] if tables else []

    def held_pages(self, request_id: str) -> list[tuple[int, int]]:
        """``(logical block, page id)`` of every page the request holds a reference on."""
        return [(i, b.block_id) for t in self.tables.get(request_id, ()) for i, b in enumerate(t) if b is not None]

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        tables = self.tables[req.request_id]
        tokens = req.all_token_ids
        hashes = self.hasher(req).update(tokens, num_computed_tokens)
        done = self.num_committed[req.request_id]
        bs = self.block_size
        for g, table in enumerate(tables):
            end = min(num_computed_tokens // bs, len(table))
            for i in range(done[g], end):
                if table[i] is not None:
                    parent = group_key(hashes[i - 1], g) if i else None
                    self.pool.cache_block(table[i], group_key(hashes[i], g), parent,
                                          tokens[i * bs : (i + 1) * bs], req.adapter_id, g)
            done[g] = max(done[g], end)

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> bool:
        """As :meth:`KVCacheManager.fork`, per group: shared full blocks (given-back ones stay
        ``None``), the partial last block copied in each group."""
        if child.request_id in self.tables:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        tables = self.tables[parent.request_id]
        full, partial = divmod(num_tokens, self.block_size)
        if any(len(t) < full + (1 if partial else 0) for t in tables):
            raise ValueError(f"request {parent.request_id!r} holds no KV for {num_tokens} tokens")
        if partial and not self.make_room(len(tables)):
            return False
        child_tables = []
        for table in tables:
            shared = table[:full]
            self.pool.touch([b for b in shared if b is not None])
            if partial:
                new = self.pool.get_new_blocks(1)[0]
                self.pending_copies.append(BlockCopy(table[full].block_id, new.block_id, partial))
                shared = shared + [new]
            child_tables.append(list(shared))
        self.tables[child.request_id] = child_tables
        self.num_committed[child.request_id] = [min(c, full) for c in self.num_committed[parent.request_id]]
        self.stats.requests += 1
        self.stats.queries += num_tokens
        self.stats.hits += num_tokens
        return True

    def free(self, req: CacheRequest) -> None:
        tables = self.tables.pop(req.request_id, [])
        self.hashers.pop(req.request_id, None)
        self.num_committed.pop(req.request_id, None)
        for table in tables:
            self.pool.free_blocks([b for b in reversed(table) if b is not None], getattr(req, "priority", 0))

    # ---- the rest of the interface -------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        if self.tables or not self.pool.reset_prefix_cache():
            return False
        self.pins.clear()
        return True

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                   adapter_id: str | None = None) -> PinResult:
        """Pin the pages a hit on ``token_ids`` (all but its last token) would take."""
        if not self.enable_caching:
            return PinResult(None, 0, 0)
        probe = PlainRequest("\0pin", list(token_ids) + [0], cache_salt, adapter_id)
        match = self.match_prefix(probe)
        self.hashers.pop(probe.request_id, None)
        blocks = [b for t in match.group_blocks for b in t if b is not None] if isinstance(match, HybridMatch) else []
        return self._pin_blocks(blocks, match.num_tokens)
