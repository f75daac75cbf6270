"""TierLoader: slow-tier loads on background threads, so the engine thread never waits on I/O.

``submit`` returns a ``concurrent.futures.Future`` whose result is a verified
:class:`~kvmosaic.tiers.stack.Loaded` or None, and which carries ``deadline`` (a
``time.monotonic()`` value) so a scheduler can poll ``done()`` and give up on its own.
Invariants (tests/test_tiers_stack.py::test_loader_*):

- a future never raises: an exception inside a load is counted in ``failed_loads`` and resolves
  to None (a miss);
- a load past its deadline is a miss: skipped if the deadline passed before the worker started it,
  dropped if it finished too late; ``result(future)`` waits at most until the deadline, then
  returns None even while the worker is still busy. Each late load is counted once, in
  ``late_loads`` (and in the asked tier's ``stats.late_loads`` when a tier was named).

See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

from .format import BlockMeta
from .stack import Loaded, TierStack


class TierLoader:
    def __init__(self, stack: TierStack, timeout: float = 2.0, workers: int = 4) -> None:
        self.stack = stack
        self.timeout = timeout
        self.late_loads = 0
        self.failed_loads = 0
        self._lock = threading.Lock()
        # A few workers: a disk read or a Redis round trip waits on I/O with the GIL released,
        # so a request's blocks load side by side (measured: python -m benchmarks.tiers).
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvmosaic-tier-load")

    def submit(self, key: bytes, expected: BlockMeta, tier: int | None = None,
               timeout: float | None = None) -> cf.Future:
        """Queue a load of block ``key`` (from tier ``tier`` or the fastest holding it)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        job = {"late": False, "tier": tier, "deadline": deadline}
        fut = self._pool.submit(self._run, key, expected, job)
        fut.deadline = deadline  # type: ignore[attr-defined]
        fut.job = job  # type: ignore[attr-defined]
        return fut

    def submit_many(self, keys, metas, tiers=None, timeout: float | None = None) -> list[cf.Future]:
        tiers = tiers if tiers is not None else [None] * len(keys)
        return [self.submit(k, m, t, timeout) for k, m, t in zip(keys, metas, tiers)]

    def result(self, fut: cf.Future) -> Loaded | None:
        """The load's result, waiting at most until its deadline; None if failed or late."""
        remaining = fut.deadline - time.monotonic()  # type: ignore[attr-defined]
        try:
            return fut.result(timeout=max(0.0, remaining))
        except cf.TimeoutError:
            self._late(fut.job)  # type: ignore[attr-defined]
            return None

    def gather(self, futs: list[cf.Future]) -> list[Loaded | None]:
        return [self.result(f) for f in futs]

    def _run(self, key: bytes, expected: BlockMeta, job: dict) -> Loaded | None:
        if time.monotonic() > job["deadline"]:
            self._late(job)
            return None
        try:
            out = self.stack.load(key, expected, job["tier"])
        except Exception:  # noqa: BLE001 - a failed load is a miss, never an error
            with self._lock:
                self.failed_loads += 1
            return None
        if time.monotonic() > job["deadline"]:
            self._late(job)
            return None
        return out

    def _late(self, job: dict) -> None:
        with self._lock:
            if job["late"]:
                return
            job["late"] = True
            self.late_loads += 1
        if job["tier"] is not None:
            self.stack.tiers[job["tier"]].stats.add(late_loads=1)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
