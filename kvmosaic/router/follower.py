"""Follow replicas' ZeroMQ cache event streams into a :class:`ClusterIndex`, from one thread.

Each replica gets a :class:`KVEventSubscriber` (it repairs sequence gaps by replay). A
subscriber that joins late (first batch numbered above 0) first replays what the publisher
still holds from 0, so the view starts complete. ``add``/``remove`` may be called from any
thread; the index is only written under ``lock``, which readers (the policy) also take.
"""

from __future__ import annotations

import logging
import threading

from ..server.events import KVEventSubscriber
from .index import ClusterIndex

log = logging.getLogger("kvmosaic.router")


class EventFollower:
    def __init__(self, index: ClusterIndex, poll_s: float = 0.005) -> None:
        self.index, self.poll_s = index, poll_s
        self.lock = threading.RLock()
        self._subs: dict[str, KVEventSubscriber] = {}
        self._endpoints: dict[str, tuple[str, str | None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmosaic-router-events", daemon=True)
        self._thread.start()

    def add(self, replica_id: str, endpoint: str, replay_endpoint: str | None, instance: str | None = None) -> None:
        """Follow a replica (again, when its endpoint or instance changed: a restart)."""
        with self.lock:
            if self._endpoints.get(replica_id) == (endpoint, replay_endpoint) and (
                    self.index.replicas.get(replica_id) and self.index.replicas[replica_id].instance == instance):
                return
            old = self._subs.pop(replica_id, None)
            if old is not None:
                old.close()
                self.index.remove_replica(replica_id)
            self.index.add_replica(replica_id, instance)
            self._subs[replica_id] = KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint)
            self._endpoints[replica_id] = (endpoint, replay_endpoint)

    def remove(self, replica_id: str) -> None:
        with self.lock:
            sub = self._subs.pop(replica_id, None)
            self._endpoints.pop(replica_id, None)
            if sub is not None:
                sub.close()
            self.index.remove_replica(replica_id)

    def replicas(self) -> set[str]:
        with self.lock:
            return set(self._subs)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                subs = list(self._subs.items())
            got = False
            for rid, sub in subs:
                try:
                    while (item := sub.recv(timeout=0)) is not None:
                        got = True
                        self._apply(rid, sub, *item)
                except Exception:  # a replica going away mid-read must not stop the others
                    log.exception("event stream of %s failed", rid)
            if not got:
                self._stop.wait(self.poll_s)

    def _apply(self, rid: str, sub: KVEventSubscriber, seq: int, batch) -> None:
        with self.lock:
            if rid not in self._subs:
                return
            view = self.index.replicas.get(rid)
            if view is not None and view.next_seq is None and seq > 0 and sub.replay_endpoint:
                for s, b in sub.replay(0, seq):
                    self.index.apply(rid, s, b)
            self.index.apply(rid, seq, batch)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self.lock:
            for sub in self._subs.values():
                sub.close()
            self._subs.clear()
