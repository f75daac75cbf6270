"""DiskTier: one file per block in a directory; survives restart; LRU, bounded in bytes.

Layout: ``<root>/<first 2 hex digits>/<hex key>.kv`` (a 256-way fan-out keeps directories small).

Invariants (tests/test_tiers_stores.py):

- atomic writes: a value is written to ``.<hex>.<pid>.<random>.tmp`` in the same directory,
  flushed and fsynced, then ``os.replace``d onto its name. A crash at any point leaves the old
  entry or the whole new one, never part of one (test_disk_crash_before_rename_*); leftover
  temporary files are deleted when a DiskTier opens the directory.
- restart: opening a directory rebuilds the LRU index from the files' sizes and mtimes (a ``get``
  touches the mtime, so the order survives restart); entries beyond the budget are evicted.
- ``used_bytes`` is the sum of the indexed files' sizes and never exceeds ``capacity_bytes``.
- a file that disappears or cannot be read is a miss (counted in ``stats.errors`` if it is an
  I/O error); a file whose content fails the format checks is deleted by the TierStack.

One process owns a directory at a time (processes share blocks through the Redis tier). After a
power loss a just-renamed entry may be missing (the directory itself is not fsynced), never partial.
See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

from .base import Policy, Tier

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class DiskTier(Tier):
    medium = "disk"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        name: str | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
        fsync: bool = True,
    ) -> None:
        super().__init__(name, capacity_bytes, policy, hit_threshold)
        self.root = Path(path)
        self.fsync = fsync
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> size, LRU first
        self._used = 0
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_temp_files = self._scan()

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _scan(self) -> int:
        """Rebuild the index from the directory; delete leftover temporary files."""
        found: list[tuple[int, bytes, int]] = []
        removed = 0
        for sub in self.root.iterdir():
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink(entry.path)
                    removed += 1
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._evict_to(self.capacity_bytes)
        return removed

    # -- Tier API ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys) -> list[bool]:
        with self._lock:
            found = [k in self._index for k in keys]
        self.stats.add(queries=len(found), hits=sum(found))
        return found

    def put(self, key: bytes, value: bytes) -> bool:
        size = len(value)
        if size > self.capacity_bytes:
            self.stats.add(store_rejected=1)
            return False
        final = self.path_for(key)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            with self._lock:
                os.replace(tmp, final)
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                self._index[key] = size
                self._used += size
                self._evict_to(self.capacity_bytes)
        except OSError:
            _unlink(tmp)
            self.stats.add(errors=1, store_rejected=1)
            return False
        self.stats.add(stores=1, bytes_stored=size)
        return True

    def get(self, key: bytes) -> bytes | None:
        t0 = time.perf_counter()
        self.stats.add(loads=1)
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
            with contextlib.suppress(OSError):
                os.utime(path)  # keeps the LRU order across restarts; a read-only dir still reads
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError:
            self.stats.add(errors=1)
            return None
        self.stats.add(load_hits=1, bytes_loaded=len(value))
        self.stats.record_load_latency(time.perf_counter() - t0)
        return value

    def delete(self, key: bytes) -> None:
        with self._lock:
            if self._forget_locked(key):
                _unlink(self.path_for(key))

    def clear(self) -> None:
        with self._lock:
            for key in list(self._index):
                _unlink(self.path_for(key))
            self._index.clear()
            self._used = 0

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._index)

    # -- internals ---------------------------------------------------------------------------
    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._forget_locked(key)

    def _forget_locked(self, key: bytes) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        return True

    def _evict_to(self, budget: int) -> None:
        evicted_bytes = 0
        victims: list[bytes] = []
        while self._used > budget and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            _unlink(self.path_for(key))
            victims.append(key)
            evicted_bytes += size
        if victims:
            self.stats.add(evictions=len(victims), bytes_evicted=evicted_bytes)
            self._removed(victims)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
