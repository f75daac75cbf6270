"""KV block residency, sampled: vLLM's ``kv_block_lifetime_seconds``,
``kv_block_idle_before_evict_seconds`` and ``kv_block_reuse_gap_seconds``.

A block handed out by the pool is *sampled* with probability ``sample`` (vLLM's
``--kv-cache-metrics-sample``); for a sampled block we keep its allocation time, its last
access and the gaps between its accesses (the most recent :data:`MAX_GAPS`). When the pool
evicts it (its content leaves the index because memory was needed), three observations are
recorded: lifetime (allocation -> eviction), idle (last access -> eviction) and each reuse gap.

Invariants: only the pool's own calls change the state (``allocated``, ``accessed``,
``evicted``, ``cleared``), all from the engine thread; ``snapshot()`` may be called from any
thread and returns cumulative, never-decreasing bucket counts (a consistent copy under the
lock). A block re-allocated without an eviction (it was free, not cached) starts afresh. No
torch: this is the bookkeeping layer. Test: tests/test_metrics_vllm.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable

#: vLLM's residency buckets (seconds); the last bucket is +Inf.
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
                     600, 1200, 1800)
MAX_GAPS = 4  # vLLM keeps a small ring of the most recent accesses
HISTOGRAMS = ("lifetime", "idle_before_evict", "reuse_gap")


class _Hist:
    __slots__ = ("buckets", "sum", "count")

    def __init__(self) -> None:
        self.buckets, self.sum, self.count = [0] * (len(RESIDENCY_BUCKETS) + 1), 0.0, 0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(RESIDENCY_BUCKETS) and v > RESIDENCY_BUCKETS[i]:
            i += 1
        self.buckets[i] += 1
        self.sum += v
        self.count += 1


class BlockResidency:
    """Per sampled block: ``[allocated_at, last_access, gaps]``, keyed by block id."""

    def __init__(self, sample: float, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"the residency sample rate is a fraction in [0, 1], not {sample}")
        self.sample = sample
        self.clock = clock
        self.rng = rng or random.Random()
        self._live: dict[int, list] = {}
        self._hists = {name: _Hist() for name in HISTOGRAMS}
        self._lock = threading.Lock()

    def allocated(self, block_id: int) -> None:
        if self.sample and (self.sample >= 1.0 or self.rng.random() < self.sample):
            now = self.clock()
            self._live[block_id] = [now, now, deque(maxlen=MAX_GAPS)]
        else:
            self._live.pop(block_id, None)

    def accessed(self, block_id: int) -> None:
        rec = self._live.get(block_id)
        if rec is not None:
            now = self.clock()
            rec[2].append(now - rec[1])
            rec[1] = now

    def evicted(self, block_id: int) -> None:
        rec = self._live.pop(block_id, None)
        if rec is None:
            return
        now = self.clock()
        with self._lock:
            self._hists["lifetime"].observe(now - rec[0])
            self._hists["idle_before_evict"].observe(now - rec[1])
            for gap in rec[2]:
                self._hists["reuse_gap"].observe(gap)

    def cleared(self) -> None:
        """The cache was reset: nothing was evicted for want of memory, so nothing is observed."""
        self._live.clear()

    def snapshot(self) -> dict[str, dict]:
        """``{name: {"buckets": [per-bucket counts, +Inf last], "sum": s, "count": n}}``."""
        with self._lock:
            return {name: {"buckets": list(h.buckets), "sum": h.sum, "count": h.count}
                    for name, h in self._hists.items()}
