"""HostTier: encoded KV blocks in process RAM, LRU, bounded in bytes.

Invariants (tests/test_tiers_stores.py): ``used_bytes`` equals the sum of the stored values'
lengths and never exceeds ``capacity_bytes``; ``get`` and ``put`` make a key the most recently
used; eviction takes the least recently used first; a value larger than the whole budget is
refused (``put`` returns False) without evicting anything. Thread-safe (one lock), so the loader
thread can read while the engine thread writes.

This tier is byte-level; pinned host tensors and asynchronous device copies belong to kv/.
See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .base import Policy, Tier


class HostTier(Tier):
    medium = "host"

    def __init__(
        self,
        capacity_bytes: int,
        name: str | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
    ) -> None:
        super().__init__(name, capacity_bytes, policy, hit_threshold)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys) -> list[bool]:
        with self._lock:
            found = [k in self._entries for k in keys]
        self.stats.add(queries=len(found), hits=sum(found))
        return found

    def put(self, key: bytes, value: bytes) -> bool:
        value = bytes(value)
        size = len(value)
        if size > self.capacity_bytes:
            self.stats.add(store_rejected=1)
            return False
        evicted_bytes = 0
        victims: list[bytes] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
            while self._used + size > self.capacity_bytes:
                victim, data = self._entries.popitem(last=False)
                self._used -= len(data)
                victims.append(victim)
                evicted_bytes += len(data)
            self._entries[key] = value
            self._used += size
        self.stats.add(stores=1, bytes_stored=size, evictions=len(victims), bytes_evicted=evicted_bytes)
        self._removed(victims)
        return True

    def get(self, key: bytes) -> bytes | None:
        t0 = time.perf_counter()
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
        self.stats.add(loads=1)
        if value is None:
            return None
        self.stats.add(load_hits=1, bytes_loaded=len(value))
        self.stats.record_load_latency(time.perf_counter() - t0)
        return value

    def delete(self, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)
