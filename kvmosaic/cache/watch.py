"""What the content index held and lost: the memory behind live miss reasons (issue 23).

:class:`CacheWatch` is the pool's :class:`~.block_pool.BlockObserver` (both backends name every
full block by its chain hash through ``BlockPool.cache_block`` / ``uncache_block``); it forwards
every call to the observer it wraps (the storage tiers' connector, or None) and keeps, for the
blocks indexed now:

* ``parent_of`` / ``children``: the chain's shape (a sibling of a missed block means the prompt
  *diverged* from something cached);
* ``plain_of`` / ``plain_count``: a namespace-free key of each block's content and history
  (``hash((parent's key, tokens))``; the salt and adapter are left out), so a block missed in
  one namespace but held under another is recognised (the *namespace* reason, admin views only);
* ``ghosts``: the last ``max_ghosts`` hashes evicted (LRU order; an older eviction reads as cold);
* ``owner``: per chain hash, the tenant label that first asked for it and when it was last
  asked for (bounded like ``ghosts``), for per-tenant figures and the dashboard;
* ``tokens``: each cached block's token ids, only when ``keep_tokens`` (``--dashboard-show-text``).

Invariants: ``parent_of``, ``plain_of`` (and ``tokens`` when kept) have exactly the keys of
``BlockPool.cached`` (the pool reports every entry and exit, and :meth:`on_reset` follows a
reset); a hash is never both cached and a ghost; nothing here changes what the pool or the
wrapped observer do. No torch (the bookkeeping layer).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from .block import KVBlock
from .hashing import BlockHash

ROOT_KEY = 0x6B766D6F  # the namespace-free key before the first block


def plain_key(parent: int, tokens: Sequence[int]) -> int:
    """The namespace-free key of a block after ``parent``'s (diagnostic only: a collision can
    mislabel a miss reason, never serve KV)."""
    return hash((parent, tuple(tokens)))


class CacheWatch:
    def __init__(self, inner=None, max_ghosts: int = 65536, keep_tokens: bool = False) -> None:
        self.inner = inner
        self.max_ghosts = max_ghosts
        self.keep_tokens = keep_tokens
        self.parent_of: dict[BlockHash, BlockHash | None] = {}
        self.children: dict[BlockHash, set[BlockHash]] = {}
        self.plain_of: dict[BlockHash, int] = {}
        self.plain_count: dict[int, int] = {}
        self.ghosts: OrderedDict[BlockHash, None] = OrderedDict()
        self.owner: OrderedDict[BlockHash, list] = OrderedDict()  # hash -> [tenant, last asked (time)]
        self.tokens: dict[BlockHash, tuple[int, ...]] = {}
        self.cached_at: dict[BlockHash, float] = {}

    # ---- the pool's observer -------------------------------------------------------------
    def on_cache(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                 token_ids: Sequence[int]) -> None:
        self.ghosts.pop(block_hash, None)
        self.parent_of[block_hash] = parent_hash
        if parent_hash is not None:
            self.children.setdefault(parent_hash, set()).add(block_hash)
        parent_plain = ROOT_KEY if parent_hash is None else self.plain_of.get(parent_hash)
        if parent_plain is not None:  # a parent evicted first leaves its child without a key
            key = plain_key(parent_plain, token_ids)
            self.plain_of[block_hash] = key
            self.plain_count[key] = self.plain_count.get(key, 0) + 1
        if self.keep_tokens:
            self.tokens[block_hash] = tuple(token_ids)
        self.cached_at[block_hash] = time.time()
        if self.inner is not None:
            self.inner.on_cache(block, block_hash, parent_hash, token_ids)

    def on_uncache(self, block: KVBlock, block_hash: BlockHash, evicted: bool) -> None:
        if self.inner is not None:
            self.inner.on_uncache(block, block_hash, evicted)
        self._forget(block_hash)
        self.ghosts[block_hash] = None
        if len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)

    def on_hit(self, block: KVBlock) -> None:
        if self.inner is not None:
            self.inner.on_hit(block)

    def on_reset(self, cached: Sequence[BlockHash]) -> None:
        """The pool forgot ``cached`` at once (``reset_prefix_cache``): they become ghosts."""
        for h in cached:
            self._forget(h)
            self.ghosts[h] = None
        while len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)
        self.children.clear()

    def _forget(self, block_hash: BlockHash) -> None:
        parent = self.parent_of.pop(block_hash, None)
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids.discard(block_hash)
                if not kids:
                    del self.children[parent]
        key = self.plain_of.pop(block_hash, None)
        if key is not None:
            n = self.plain_count[key] - 1
            if n:
                self.plain_count[key] = n
            else:
                del self.plain_count[key]
        self.tokens.pop(block_hash, None)
        self.cached_at.pop(block_hash, None)

    # ---- questions -----------------------------------------------------------------------
    def has_sibling(self, parent: BlockHash, block_hash: BlockHash) -> bool:
        """A cached block other than ``block_hash`` follows ``parent`` in the chain."""
        kids = self.children.get(parent)
        return bool(kids) and (len(kids) > 1 or block_hash not in kids)

    def note_request(self, hashes: Sequence[BlockHash], tenant: str | None, now: float) -> None:
        """A request of ``tenant`` asked for these blocks (hit or about to compute them)."""
        owner = self.owner
        for h in hashes:
            entry = owner.get(h)
            if entry is None:
                owner[h] = [tenant, now]
            else:
                entry[1] = now
                owner.move_to_end(h)
        while len(owner) > self.max_ghosts:
            owner.popitem(last=False)
