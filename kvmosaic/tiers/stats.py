"""Per-tier counters that a /metrics exporter reads (names follow vLLM's style).

Invariant: counters only grow (``reset()`` aside); ``snapshot()`` is a consistent copy taken under
the lock, safe to call from any thread while the engine thread and the loader thread record.
Held by tests/test_tiers_host.py.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

#: Upper bounds (seconds) of the load-latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    queries: int = 0          # keys asked about by lookups (contains / contains_many)
    hits: int = 0             # of those, found
    loads: int = 0            # get() calls
    load_hits: int = 0        # get() calls that returned a value
    bytes_loaded: int = 0
    stores: int = 0           # values accepted by put()
    store_rejected: int = 0   # values put() refused (too large, error)
    bytes_stored: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    corrupt: int = 0          # entries that failed a format check (dropped, counted as misses)
    corrupt_reasons: Counter = field(default_factory=Counter)
    errors: int = 0           # I/O or connection errors (each one a miss, never an exception)
    late_loads: int = 0       # background loads that missed their deadline
    load_latency_count: int = 0
    load_latency_sum: float = 0.0
    load_latency_buckets: list = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    load_latency_samples: deque = field(default_factory=lambda: deque(maxlen=1024))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def record_corrupt(self, reason: str) -> None:
        with self._lock:
            self.corrupt += 1
            self.corrupt_reasons[reason] += 1

    def record_load_latency(self, seconds: float) -> None:
        with self._lock:
            self.load_latency_count += 1
            self.load_latency_sum += seconds
            self.load_latency_samples.append(seconds)
            i = 0
            while i < len(LATENCY_BUCKETS) and seconds > LATENCY_BUCKETS[i]:
                i += 1
            self.load_latency_buckets[i] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = {k: v for k, v in vars(self).items() if not k.startswith("_")}
            out["corrupt_reasons"] = dict(self.corrupt_reasons)
            out["load_latency_buckets"] = list(self.load_latency_buckets)
            out["load_latency_samples"] = list(self.load_latency_samples)
            return out

    def reset(self) -> None:
        fresh = TierStats()
        with self._lock:
            for k, v in vars(fresh).items():
                if not k.startswith("_"):
                    setattr(self, k, v)
