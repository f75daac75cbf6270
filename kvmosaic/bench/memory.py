"""Peak resident memory of this process, sampled by a thread while a block of work runs.

Each peer runs in its own worker process, so its RSS is its own: the figure reported is the
peak RSS during a workload's requests minus the RSS before the peer's model was loaded
(weights + KV caches + activations; the interpreter and imported libraries are excluded).
"""

from __future__ import annotations

import threading

import psutil


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


class PeakRSS:
    """``with PeakRSS() as p: ...`` then ``p.peak``; samples every ``interval`` seconds
    (sparsely, so the sampling thread barely competes with the engine for the GIL)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
