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
credit: a hit in a slow tier is worth less than one in the pool. A replica that announced a
block in several media is credited for the best of them (its pool, not the tier it also wrote).

**Shared tiers** (``SHARED_MEDIA``: Redis). A block one replica announced in a shared medium
can be loaded by every replica configured with that tier, so :meth:`ClusterIndex.match` counts
it as held, at that medium's credit, by every replica that has announced the same shared medium
(``ReplicaView.shared_media``: the replicas that have that tier), not only by its writer. The
events name a medium, not an address: replicas announcing the same shared medium are taken to
share one store (``kvmosaic serve`` gives every replica the same ``--kv-tier``). The index
knows a shared block while some replica's view holds it (it leaves with the last holder's
view, e.g. when every holder's pool evicted it); Redis evicts silently, so the credit is a
prediction and a block Redis dropped costs a miss (the replica computes it), not an error.
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


# Media that every replica configured with the tier reads and writes (one store, not a copy each).
SHARED_MEDIA = frozenset({"redis"})


def tier_credit(medium: str | None) -> float:
    return 1.0 if medium is None else TIER_CREDIT.get(medium.lower(), 0.5)


def shared_medium(medium: str | None) -> str | None:
    """``medium`` normalised when it names a shared tier, else None."""
    m = medium.lower() if medium else None
    return m if m in SHARED_MEDIA else None


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
    # Shared media this replica announced a block in: it has those tiers (kept across resets,
    # which clear its cache, not its configuration).
    shared_media: set[str] = field(default_factory=set)


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
        self.holders: dict[bytes, dict[str, str | None]] = {}  # hash -> replica -> its best medium
        self.replicas: dict[str, ReplicaView] = {}
        # Shared tiers: hash -> shared media announced holding it (only for hashes in
        # ``holders``), and shared medium -> replicas that have it.
        self.shared: dict[bytes, set[str]] = {}
        self.sharing: dict[str, set[str]] = {}
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
            for m in self.replicas[replica_id].shared_media:
                self.sharing[m].discard(replica_id)
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
            self._drop_holder(h, replica_id)
        view.blocks.parent.clear()

    def _drop_holder(self, h: bytes, replica_id: str) -> None:
        hold = self.holders.get(h)
        if hold is not None:
            hold.pop(replica_id, None)
            if not hold:
                del self.holders[h]
                self.shared.pop(h, None)

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
            shared = shared_medium(ev.medium)
            if shared is not None and shared not in view.shared_media:
                view.shared_media.add(shared)
                self.sharing.setdefault(shared, set()).add(rid)
            credit = tier_credit(ev.medium)
            for h in ev.block_hashes:
                hold = self.holders.setdefault(h, {})
                if rid not in hold or credit > tier_credit(hold[rid]):
                    hold[rid] = ev.medium
                if shared is not None:
                    self.shared.setdefault(h, set()).add(shared)
        elif isinstance(ev, BlockRemoved):
            shared = shared_medium(ev.medium)
            for h in ev.block_hashes:
                if shared is not None and h in self.shared:  # the one store dropped it, for all
                    self.shared[h].discard(shared)
                self._drop_holder(h, rid)
        elif isinstance(ev, AllBlocksCleared):
            self._forget(rid)
            view.stale = False

    # ---- queries -------------------------------------------------------------------------
    def fresh(self, replica_id: str) -> bool:
        """Whether the view can be trusted: known, no unrepaired gap, recent enough."""
        view = self.replicas.get(replica_id)
        return view is not None and not view.stale and view.lag_s <= self.max_lag_s

    def expects(self, replica_id: str, block_hash: bytes, now: float | None = None) -> bool:
        """Whether this router sent the replica a prompt starting with ``block_hash`` whose
        expectation has not expired: its own record, true whatever the replica's events say yet."""
        until = self.expected.get(block_hash, {}).get(replica_id)
        return until is not None and until > (self.clock() if now is None else now)

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
        """Each replica's leading run of ``chain`` (only replicas holding its first block, or
        having a shared tier that holds it).

        With ``expected``, expectations count as held (credit 1; expired ones are swept by
        :meth:`expect`). A replica's blocks of one chain form a prefix of it (a block is
        stored after its parent; eviction takes a chain's tail first), and so do a shared
        tier's, so each candidate's run is found by binary search: O(candidates x
        log(blocks)), not O(candidates x blocks). A replica's own run is credited per block at
        the medium its first block is on; the blocks past it that only a shared tier it has
        holds (module docstring), at that tier's credit.
        """
        if not chain:
            return {}
        empty: dict = {}
        holders, expect, shared = self.holders, (self.expected if expected else empty), self.shared
        stored = holders.get(chain[0], empty)
        live = stored.keys() | expect.get(chain[0], empty).keys()
        for m in shared.get(chain[0], ()):
            live |= self.sharing.get(m, set())
        if replica_ids is not None:
            live &= set(replica_ids)
        bs, n, out = self.block_size, len(chain), {}

        def own(r: str, h: bytes) -> bool:
            return r in holders.get(h, empty) or r in expect.get(h, empty)

        def run(held: Callable[[bytes], bool], lo: int) -> int:
            hi = n  # chain[:lo] held; chain[hi:] not known held
            while lo < hi:
                mid = (lo + hi) // 2
                if held(chain[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            return lo

        for r in live:
            mine = run(lambda h, r=r: own(r, h), 1) if own(r, chain[0]) else 0
            total = mine
            credit = mine * (tier_credit(stored[r]) if r in stored else 1.0)
            for m in self.replicas[r].shared_media if r in self.replicas and mine < n else ():
                got = run(lambda h, r=r, m=m: own(r, h) or m in shared.get(h, empty), mine)
                if got > total:  # the shared tier holds more: its blocks past the own run
                    total, credit = got, credit + (got - mine) * tier_credit(m)
                    break  # (a replica has one shared tier in practice)
            out[r] = Match(total, credit * bs)
        return out

    def cached_hashes(self, replica_id: str) -> set[bytes]:
        return set(self.replicas[replica_id].blocks.parent)

    def total_gaps(self) -> int:
        return sum(v.gaps for v in self.replicas.values())
