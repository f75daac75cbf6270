"""Cache events, shaped like vLLM's KV events so a router can follow what a replica holds.

The block pool (for both backends) appends events to an :class:`EventLog`; a publisher (see
``server/events.py``) drains it after each engine step. Hashes are the raw block-hash bytes.
``medium`` names where the block lives, as vLLM's events do ("GPU" or "CPU" for the pool; a
storage tier reports its own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: str | None = None
    medium: str = "CPU"
    # The KV cache group (cache/kv_groups.py) whose page this is, as vLLM's events name it.
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "CPU"
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventLog:
    """A bounded buffer of events; disabled logs drop everything at no cost.

    Past ``max_pending`` undrained events, new ones are dropped and counted: ``num_dropped``
    (for /metrics) and ``dropped_since_drain``, which the publisher turns into a skipped
    sequence number, so a subscriber sees the loss as a gap and rebuilds its view (a dropped
    event cannot be replayed: the view must be reset, not patched).
    """

    enabled: bool = False
    max_pending: int = 100_000
    pending: list[KVCacheEvent] = field(default_factory=list)
    num_dropped: int = 0
    dropped_since_drain: int = 0
    # The engine thread emits, and so do the storage tiers' writer threads (tier media).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def emit(self, event: KVCacheEvent) -> None:
        if not self.enabled:
            return
        with self._lock:
            if len(self.pending) < self.max_pending:
                self.pending.append(event)
            else:
                self.num_dropped += 1
                self.dropped_since_drain += 1

    def drain(self) -> tuple[list[KVCacheEvent], int]:
        """The pending events, and how many were dropped since the last drain."""
        with self._lock:
            out, self.pending = self.pending, []
            dropped, self.dropped_since_drain = self.dropped_since_drain, 0
        return out, dropped
