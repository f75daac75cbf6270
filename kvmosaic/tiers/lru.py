"""The in-process LRU index that the host and disk tiers share.

``LruIndex`` is the bookkeeping: keys in use order, each with an entry and its size in bytes.
``LruTier`` is the part of the Tier API that only reads that index (``used_bytes``, ``len``,
``contains``/``contains_many`` with their counters, ``keys``). What an entry is (the value
itself in RAM, a file's size on disk) and what dropping one costs (nothing, an unlink) stays in
host.py and disk.py. See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from .base import Policy, Tier

E = TypeVar("E")


class LruIndex(Generic[E]):
    """Keys from least to most recently used, each with an entry of ``size_of(entry)`` bytes.

    Invariant (tests/test_tiers_host.py): ``used_bytes`` equals the sum of the entries' sizes
    at all times, and is at most ``capacity_bytes`` whenever ``insert`` or ``evict_to`` returns:
    ``insert`` evicts from the least recently used end until the budget holds (the caller refuses
    an entry larger than the whole budget beforehand, so the new entry itself is never evicted).

    Every method takes ``lock``, a reentrant lock, so each call is atomic; a caller holds
    ``lock`` around a longer step that must not interleave with others (disk: rename a file and
    index it, or unlink files while their keys leave the index).
    """

    def __init__(self, capacity_bytes: int, size_of: Callable[[E], int]) -> None:
        self.capacity_bytes = capacity_bytes
        self._size_of = size_of
        self._entries: OrderedDict[bytes, E] = OrderedDict()
        self._used = 0
        self.lock = threading.RLock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key: bytes) -> E:
        with self.lock:
            return self._entries[key]

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used (a copy)."""
        with self.lock:
            return list(self._entries)

    def values(self) -> list[E]:
        """Entries from least to most recently used (a copy)."""
        with self.lock:
            return list(self._entries.values())

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        with self.lock:
            return [k in self._entries for k in keys]

    def get(self, key: bytes) -> E | None:
        """The entry for ``key``, now the most recently used; None if absent."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def insert(self, key: bytes, entry: E) -> list[tuple[bytes, E]]:
        """Store ``entry`` as the most recently used (replacing any old one); evict to the budget.

        Returns the evicted ``(key, entry)`` pairs, least recently used first.
        """
        with self.lock:
            self.pop(key)
            self._entries[key] = entry
            self._used += self._size_of(entry)
            return self.evict_to(self.capacity_bytes)

    def pop(self, key: bytes) -> E | None:
        """Remove ``key``; its entry, or None if it was absent."""
        with self.lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= self._size_of(entry)
            return entry

    def evict_to(self, budget: int) -> list[tuple[bytes, E]]:
        """Drop least recently used entries until ``used_bytes <= budget``; return them."""
        victims: list[tuple[bytes, E]] = []
        with self.lock:
            while self._used > budget and self._entries:
                key, entry = self._entries.popitem(last=False)
                self._used -= self._size_of(entry)
                victims.append((key, entry))
        return victims

    def clear(self) -> None:
        with self.lock:
            self._entries.clear()
            self._used = 0


class LruTier(Tier):
    """A tier whose keys live in an ``LruIndex`` (``self._lru``): lookups never touch the medium."""

    def __init__(
        self,
        capacity_bytes: int,
        size_of: Callable,
        name: str | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
    ) -> None:
        super().__init__(name, capacity_bytes, policy, hit_threshold)
        self._lru: LruIndex = LruIndex(capacity_bytes, size_of)

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys) -> list[bool]:
        found = self._lru.contains_many(keys)
        self.stats.add(queries=len(found), hits=sum(found))
        return found

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return self._lru.keys()
