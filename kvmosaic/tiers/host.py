"""HostTier: encoded KV blocks in process RAM, LRU, bounded in bytes.

Invariants (tests/test_tiers_host.py): ``used_bytes`` equals the sum of the stored values'
lengths and never exceeds ``capacity_bytes``; ``get`` and ``put`` make a key the most recently
used; eviction takes the least recently used first; a value larger than the whole budget is
refused (``put`` returns False) without evicting anything. Thread-safe (the LruIndex's lock,
lru.py), so the loader thread can read while the engine thread writes.

This tier is byte-level; pinned host tensors and asynchronous device copies belong to kv/.
See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import time

from .base import Policy
from .lru import LruTier


class HostTier(LruTier):
    medium = "host"

    def __init__(
        self,
        capacity_bytes: int,
        name: str | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
    ) -> None:
        super().__init__(capacity_bytes, len, name, policy, hit_threshold)  # entry: the value

    def put(self, key: bytes, value: bytes) -> bool:
        value = bytes(value)
        size = len(value)
        if size > self.capacity_bytes:
            self.stats.add(store_rejected=1)
            return False
        victims = self._lru.insert(key, value)
        self.stats.add(stores=1, bytes_stored=size, evictions=len(victims),
                       bytes_evicted=sum(len(data) for _, data in victims))
        self._removed([victim for victim, _ in victims])
        return True

    def get(self, key: bytes) -> bytes | None:
        t0 = time.perf_counter()
        value = self._lru.get(key)
        self.stats.add(loads=1)
        if value is None:
            return None
        self.stats.add(load_hits=1, bytes_loaded=len(value))
        self.stats.record_load_latency(time.perf_counter() - t0)
        return value

    def delete(self, key: bytes) -> None:
        self._lru.pop(key)

    def clear(self) -> None:
        self._lru.clear()
