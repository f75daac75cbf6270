"""Eviction orders: which cached KV goes first when memory is short.

One set of policies serves both backends. Each orders victims by what it knows of an entry
(a pool block for the hash backend, a tree leaf for the radix backend):

* ``lru``      least recently used first (the default; O(1) in the pool);
* ``lfu``      least frequently used first, ties broken by recency;
* ``slru``     segmented LRU: entries used once (probation) go before entries used again
               (protected); in the pool the protected segment is bounded, its overflow falls
               back to probation, so a burst of one-off prompts cannot flush the hot set;
* ``priority`` lowest request priority first (the highest priority of any request that used
               the entry; higher number = more important), ties broken by recency.

Pinning is not a policy: a pinned entry holds a reference (pool) or a lock (tree), so no
policy can see it. The pool's evictors below hold exactly the blocks with ``ref_cnt == 0``
that still carry a hash; every method is O(1) (lists) or O(log n) amortised (heaps).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator

from .block import FreeBlockQueue, KVBlock

POLICIES = ("lru", "lfu", "slru", "priority")


def order_key(policy: str, last_access: int, hits: int, priority: int) -> tuple[int, ...]:
    """Victims first: the smallest key is evicted first (used by the radix tree)."""
    if policy == "lru":
        return (last_access,)
    if policy == "lfu":
        return (hits, last_access)
    if policy == "slru":
        return (int(hits >= 2), last_access)
    if policy == "priority":
        return (priority, last_access)
    raise ValueError(f"unknown eviction_policy {policy!r}; choose one of {POLICIES}")


class Evictor(ABC):
    """The evictable blocks (``ref_cnt == 0``, hash set), in the policy's victim order."""

    @abstractmethod
    def add(self, block: KVBlock) -> None: ...

    @abstractmethod
    def remove(self, block: KVBlock) -> None:
        """The block was hit: it leaves the evictable set."""

    @abstractmethod
    def pop(self) -> KVBlock:
        """Remove and return the next victim."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[KVBlock]: ...


class LRUEvictor(Evictor):
    """Least recently freed first: blocks enter at the tail, victims leave from the head."""

    def __init__(self) -> None:
        self.queue = FreeBlockQueue()

    def add(self, block: KVBlock) -> None:
        self.queue.append(block)

    def remove(self, block: KVBlock) -> None:
        self.queue.remove(block)

    def pop(self) -> KVBlock:
        return self.queue.popleft()

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self.queue)


class SLRUEvictor(Evictor):
    """Two LRU lists. A block used at least twice enters the protected list; when that list
    exceeds ``protected_cap`` its LRU block is demoted to probation. Victims come from
    probation first."""

    def __init__(self, protected_cap: int) -> None:
        self.probation = FreeBlockQueue()
        self.protected = FreeBlockQueue()
        self.protected_cap = max(1, protected_cap)
        self.segment: dict[int, FreeBlockQueue] = {}

    def _put(self, block: KVBlock, queue: FreeBlockQueue) -> None:
        queue.append(block)
        self.segment[block.block_id] = queue

    def add(self, block: KVBlock) -> None:
        if block.hits < 2:
            self._put(block, self.probation)
            return
        self._put(block, self.protected)
        if len(self.protected) > self.protected_cap:
            demoted = self.protected.popleft()
            self._put(demoted, self.probation)

    def remove(self, block: KVBlock) -> None:
        self.segment.pop(block.block_id).remove(block)

    def pop(self) -> KVBlock:
        queue = self.probation if len(self.probation) else self.protected
        block = queue.popleft()
        del self.segment[block.block_id]
        return block

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.probation
        yield from self.protected


class HeapEvictor(Evictor):
    """A min-heap on ``order_key`` with lazy deletion: a removed block's entry stays in the
    heap, marked stale by a per-block ticket, and is dropped when it surfaces or when stale
    entries outnumber live ones (so the heap stays O(live))."""

    def __init__(self, policy: str) -> None:
        order_key(policy, 0, 0, 0)  # validates the name
        self.policy = policy
        self.heap: list[tuple[tuple[int, ...], int, KVBlock]] = []
        self.ticket: dict[int, int] = {}  # block_id -> its live entry's ticket
        self.counter = itertools.count()

    def add(self, block: KVBlock) -> None:
        t = next(self.counter)
        self.ticket[block.block_id] = t
        key = order_key(self.policy, block.last_access, block.hits, block.priority)
        heapq.heappush(self.heap, (key, t, block))
        if len(self.heap) > 2 * len(self.ticket) + 64:
            self.heap = [e for e in self.heap if self.ticket.get(e[2].block_id) == e[1]]
            heapq.heapify(self.heap)

    def remove(self, block: KVBlock) -> None:
        del self.ticket[block.block_id]

    def pop(self) -> KVBlock:
        while self.heap:
            _, t, block = heapq.heappop(self.heap)
            if self.ticket.get(block.block_id) == t:
                del self.ticket[block.block_id]
                return block
        raise IndexError("no evictable block")

    def __len__(self) -> int:
        return len(self.ticket)

    def __iter__(self) -> Iterator[KVBlock]:
        return (e[2] for e in sorted(self.heap) if self.ticket.get(e[2].block_id) == e[1])


def make_evictor(policy: str, num_blocks: int, protected_fraction: float = 0.8) -> Evictor:
    if policy == "lru":
        return LRUEvictor()
    if policy == "slru":
        return SLRUEvictor(int(num_blocks * protected_fraction))
    return HeapEvictor(policy)
