"""Which replica holds which block: an inverted index built from replicas' cache events.

Invariants (tests: ``tests/router/test_index.py``):

* for every replica, ``holders`` and that replica's :class:`CachedBlocks` name the same hashes:
  ``{h for h, rs in holders.items() if rid in rs} == set(view.blocks.parent)``. Both change only
  in :meth:`ClusterIndex.apply`, :meth:`reset_replica` and :meth:`remove_replica`;
* batches are applied in sequence order, once. A duplicate or old batch is ignored; a jump in
  sequence numbers counts ``gaps`` and marks the replica *stale* (its view may lack blocks or
  keep evicted ones) until the cache is reset (``AllBlocksCleared``, a restart, or
  :meth:`reset_replica`). A batch numbered 0 after later ones means the publisher restarted:
  the view is reset before it is applied. A new ``instance`` for a known replica id does the same;
* a removed (dead) replica leaves no entry behind;
* :meth:`match` costs O(prompt blocks x replicas still matching), never O(replicas x blocks):
  a decision at 256 replicas stays well under a millisecond.

The ``medium`` of an event (where the block lives: the pool, or a tier below it) earns a
credit: a hit in a slow tier is worth less than one in the pool.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..server.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlocks,
    KVEventBatch,
)

# Credit per medium, as a fraction of a pool hit (loading from a slower tier is not free).
TIER_CREDIT = {"gpu": 1.0, "cpu": 1.0, "pool": 1.0, "host": 0.8, "cpu_tier": 0.8, "disk": 0.5, "redis": 0.4}


def tier_credit(medium: str | None) -> float:
    return 1.0 if medium is None else TIER_CREDIT.get(medium.lower(), 0.5)


@dataclass
class ReplicaView:
    """The index's view of one replica's cache and of how much it can be trusted."""

    replica_id: str
    instance: str | None = None
    blocks: CachedBlocks = field(default_factory=CachedBlocks)
    next_seq: int | None = None
    gaps: int = 0  # batches lost, over the view's life
    stale: bool = False  # an unrepaired gap since the last reset
    resets: int = 0
    last_event_at: float | None = None
    lag_s: float = 0.0  # arrival time - publish time of the latest batch


@dataclass(frozen=True)
class Match:
    """A replica's hold on a prompt: its first ``blocks`` blocks, worth ``credit_tokens``."""

    blocks: int
    credit_tokens: float


class ClusterIndex:
    def __init__(self, block_size: int, clock: Callable[[], float] = time.time, max_lag_s: float = 10.0) -> None:
        self.block_size = block_size
        self.clock = clock
        self.max_lag_s = max_lag_s
        self.holders: dict[bytes, dict[str, str | None]] = {}
        self.replicas: dict[str, ReplicaView] = {}
        # Blocks a replica will hold once a request routed to it has prefilled (hash ->
        # replica -> expiry): lets a burst of one tenant's requests follow the first one.
        self.expected: dict[bytes, dict[str, float]] = {}
        self._expiries: deque[tuple[float, str, list[bytes]]] = deque()  # in expiry order

    # ---- membership ----------------------------------------------------------------------
    def add_replica(self, replica_id: str, instance: str | None = None) -> ReplicaView:
        view = self.replicas.get(replica_id)
        if view is None:
            view = self.replicas[replica_id] = ReplicaView(replica_id, instance)
        elif instance is not None and view.instance != instance:
            self.reset_replica(replica_id)
            view.instance, view.next_seq = instance, None
        return view

    def remove_replica(self, replica_id: str) -> None:
        """A dead replica: route around it, forget what it held."""
        if replica_id in self.replicas:
            self._forget(replica_id)
            del self.replicas[replica_id]

    def reset_replica(self, replica_id: str) -> None:
        """The replica's cache is empty (cleared or restarted): its view is exact again."""
        view = self.replicas[replica_id]
        self._forget(replica_id)
        view.stale = False
        view.resets += 1

    def _forget(self, replica_id: str) -> None:
        view = self.replicas[replica_id]
        for exp in self.expected.values():
            exp.pop(replica_id, None)
        for h in view.blocks.parent:
            hold = self.holders.get(h)
            if hold is not None:
                hold.pop(replica_id, None)
                if not hold:
                    del self.holders[h]
        view.blocks.parent.clear()

    # ---- events --------------------------------------------------------------------------
    def apply(self, replica_id: str, seq: int, batch: KVEventBatch, now: float | None = None) -> bool:
        """Apply one batch; False when it was a duplicate and ignored."""
        view = self.replicas.get(replica_id) or self.add_replica(replica_id)
        if view.next_seq is not None and seq < view.next_seq:
            if seq != 0:
                return False
            self.reset_replica(replica_id)  # the publisher restarted: numbering begins again
        elif seq > (view.next_seq or 0):
            view.gaps += seq - (view.next_seq or 0)
            view.stale = True
        for ev in batch.events:
            self._apply_event(view, ev)
        view.blocks.apply(batch)
        view.next_seq = seq + 1
        view.last_event_at = self.clock() if now is None else now
        view.lag_s = max(0.0, view.last_event_at - batch.ts)
        return True

    def _apply_event(self, view: ReplicaView, ev) -> None:
        rid = view.replica_id
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                self.holders.setdefault(h, {})[rid] = ev.medium
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                hold = self.holders.get(h)
                if hold is not None:
                    hold.pop(rid, None)
                    if not hold:
                        del self.holders[h]
        elif isinstance(ev, AllBlocksCleared):
            self._forget(rid)
            view.stale = False

    # ---- queries -------------------------------------------------------------------------
    def fresh(self, replica_id: str) -> bool:
        """Whether the view can be trusted: known, no unrepaired gap, recent enough."""
        view = self.replicas.get(replica_id)
        return view is not None and not view.stale and view.lag_s <= self.max_lag_s

    def expect(self, replica_id: str, chain: list[bytes], ttl_s: float, now: float | None = None) -> None:
        """Count ``chain`` as held by the replica for ``ttl_s`` (until its events confirm it).
        Amortised O(len(chain)): expired expectations leave in expiry order."""
        now = self.clock() if now is None else now
        while self._expiries and self._expiries[0][0] <= now:
            until, rid, old = self._expiries.popleft()
            for h in old:
                exp = self.expected.get(h)
                if exp is not None and exp.get(rid, until + 1) <= until:
                    del exp[rid]
                    if not exp:
                        del self.expected[h]
        until = now + ttl_s
        for h in chain:
            self.expected.setdefault(h, {})[replica_id] = until
        self._expiries.append((until, replica_id, chain))

    def match(self, chain: list[bytes], replica_ids: Iterable[str] | None = None,
              expected: bool = True) -> dict[str, Match]:
        """Each replica's leading run of ``chain`` (only replicas holding its first block).

        With ``expected``, expectations count as held (credit 1; expired ones are swept by
        :meth:`expect`). A replica's blocks of one chain form a prefix of it (a block is
        stored after its parent; eviction takes a chain's tail first), so each candidate's run
        is found by binary search: O(candidates x log(blocks)), not O(candidates x blocks).
        A replica's credit per block is that of the medium its first block is on.
        """
        if not chain:
            return {}
        empty: dict = {}
        holders, expect = self.holders, (self.expected if expected else empty)
        stored = holders.get(chain[0], empty)
        live = stored.keys() | expect.get(chain[0], empty).keys()
        if replica_ids is not None:
            live &= set(replica_ids)
        bs, n, out = self.block_size, len(chain), {}
        for r in live:
            lo, hi = 1, n  # chain[:lo] held; chain[hi:] not known held
            while lo < hi:
                mid = (lo + hi) // 2
                h = chain[mid]
                if r in holders.get(h, empty) or r in expect.get(h, empty):
                    lo = mid + 1
                else:
                    hi = mid
            out[r] = Match(lo, lo * bs * (tier_credit(stored[r]) if r in stored else 1.0))
        return out

    def cached_hashes(self, replica_id: str) -> set[bytes]:
        return set(self.replicas[replica_id].blocks.parent)

    def total_gaps(self) -> int:
        return sum(v.gaps for v in self.replicas.values())
