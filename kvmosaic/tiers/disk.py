"""DiskTier: one file per block in a directory; survives restart; LRU, bounded in bytes.

Layout: ``<root>/<first 2 hex digits>/<hex key>.kv`` (a 256-way fan-out keeps directories small).

Invariants (tests/test_tiers_disk.py):

- atomic writes: a value is written to ``.<hex>.<pid>.<random>.tmp`` in the same directory,
  flushed and fsynced, then ``os.replace``d onto its name. A crash at any point leaves the old
  entry or the whole new one, never part of one (test_disk_crash_before_rename_*); leftover
  temporary files are deleted when a DiskTier opens the directory.
- restart: opening a directory rebuilds the LRU index from the files' sizes and mtimes (a ``get``
  touches the mtime, so the order survives restart); entries beyond the budget are evicted.
- ``used_bytes`` is the sum of the indexed files' sizes and never exceeds ``capacity_bytes``.
- a file that disappears or cannot be read is a miss (counted in ``stats.errors`` if it is an
  I/O error); a file whose content fails the format checks is deleted by the TierStack.

- a lost directory (deleted while running) or failing writes (a full disk, a read-only mount):
  ``state`` becomes "failing" with ``last_error`` (logged once at WARNING), the index forgets the
  entries that went with the directory (``used_bytes`` drops), the directory is recreated when
  possible and the next successful store makes the tier "up" again (logged once). ``state`` checks
  the directory itself, so /health notices a lost one without traffic.
  (tests/test_tiers_auth.py::test_disk_directory_lost_*).

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
from pathlib import Path

from .base import Policy, logger
from .lru import LruTier

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class DiskTier(LruTier):
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
        super().__init__(capacity_bytes, int, name, policy, hit_threshold)  # entry: the file's size
        self.root = Path(path)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._state = "up"
        self._state_lock = threading.Lock()
        self.removed_temp_files = self._scan()

    # -- health ------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if not os.path.isdir(self.root):  # one stat: /health notices a lost directory unprompted
            self._check_root()
        return self._state

    def _failed(self, exc: BaseException) -> None:
        with self._state_lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            old, self._state = self._state, "failing"
        if old == "up":
            self._log_state(old, "failing")

    def _ok(self) -> None:
        if self._state == "up":
            return
        with self._state_lock:
            old, self._state = self._state, "up"
        if old != "up":
            self._log_state(old, "up")

    def _check_root(self) -> bool:
        """Whether the directory is there; if it was lost, forget its entries (the files went
        with it), say so, and recreate it if possible."""
        if os.path.isdir(self.root):
            return True
        self._failed(FileNotFoundError(f"directory {self.root} is gone"))
        with self._lru.lock:
            lost = self._lru.keys()
            self._lru.clear()
        self._removed(lost)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._failed(e)
            return False
        logger.warning("storage tier %r (disk): recreated its directory %s (%d entries were lost with it)",
                       self.name, self.root, len(lost))
        return True

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
        victims = []
        with self._lru.lock:  # oldest first: what does not fit is evicted oldest first
            for _, key, size in found:
                victims += self._lru.insert(key, size)
            self._dropped(victims)
        return removed

    # -- Tier API ----------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> bool:
        size = len(value)
        if size > self.capacity_bytes:
            self.stats.add(store_rejected=1)
            return False
        error = self._try_write(key, value)
        # The directory deleted behind our back: recreate it and try once more.
        if error is not None and not os.path.isdir(self.root) and self._check_root():
            error = self._try_write(key, value)
        if error is not None:
            self.stats.add(errors=1, store_rejected=1)
            self._failed(error)
            return False
        self.stats.add(stores=1, bytes_stored=size)
        self._ok()
        return True

    def _try_write(self, key: bytes, value: bytes) -> OSError | None:
        try:
            self._write(key, value)
        except OSError as e:
            return e
        return None

    def _write(self, key: bytes, value: bytes) -> None:
        final = self.path_for(key)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            with self._lru.lock:
                os.replace(tmp, final)
                self._dropped(self._lru.insert(key, len(value)))
        except OSError:
            _unlink(tmp)
            raise

    def get(self, key: bytes) -> bytes | None:
        t0 = time.perf_counter()
        self.stats.add(loads=1)
        if self._lru.get(key) is None:
            return None
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
            with contextlib.suppress(OSError):
                os.utime(path)  # keeps the LRU order across restarts; a read-only dir still reads
        except FileNotFoundError:
            if self._check_root():  # the file alone went away (else: the directory did)
                self._lru.pop(key)
            return None
        except OSError as e:
            self.stats.add(errors=1)
            self._failed(e)
            return None
        self.stats.add(load_hits=1, bytes_loaded=len(value))
        self.stats.record_load_latency(time.perf_counter() - t0)
        return value

    def delete(self, key: bytes) -> None:
        with self._lru.lock:
            if self._lru.pop(key) is not None:
                _unlink(self.path_for(key))

    def clear(self) -> None:
        with self._lru.lock:
            for key in self._lru.keys():
                _unlink(self.path_for(key))
            self._lru.clear()

    # -- internals ---------------------------------------------------------------------------
    def _dropped(self, victims: list[tuple[bytes, int]]) -> None:
        """Delete the files of entries the index evicted (under its lock); count and announce them."""
        for key, _ in victims:
            _unlink(self.path_for(key))
        if victims:
            self.stats.add(evictions=len(victims), bytes_evicted=sum(size for _, size in victims))
            self._removed([key for key, _ in victims])


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
