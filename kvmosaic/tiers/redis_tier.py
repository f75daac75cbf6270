"""RedisTier: encoded KV blocks in a real Redis server, shared by every process pointing at it.

One ``SET <prefix><hex key> <value>`` per block (optionally with a TTL): a Redis write is atomic,
so a reader sees the old value or the whole new one. Lookups batch ``EXISTS`` in one pipeline.

Memory bound: Redis bounds itself. Run the server with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (e.g. ``redis-server --maxmemory 8gb --maxmemory-policy
allkeys-lru``; :class:`~kvmosaic.tiers.redis_server.RedisServer` takes ``maxmemory=``); Redis then
evicts least recently used keys itself, and ``server_info()`` reports its ``evicted_keys``.
``capacity_bytes`` here is informational (reported, and a value larger than it is not stored).

Outages cost misses, never exceptions (tests/test_tiers_redis.py): every call has a socket timeout
and no client-side retries; any error marks the tier ``down``, counts ``stats.errors``, drops the
pooled connections, and for the next ``backoff`` seconds calls return a miss at once without
touching the network; the first call after that is the probe (success: ``up``, backoff reset;
failure: backoff doubles up to ``max_backoff``). ``state`` (with ``last_error``) is for /health
and /metrics; going down and coming back are each logged once at WARNING.
See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from .base import Policy, Tier

KEY_PREFIX = "kvmosaic:kv:"


class RedisTier(Tier):
    medium = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379",
        capacity_bytes: int | None = None,
        name: str | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
        timeout: float = 0.5,
        ttl_s: float | None = None,
        prefix: str = KEY_PREFIX,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
    ) -> None:
        import redis  # the optional `tiers` extra; imported here so the package stays light
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        super().__init__(name, capacity_bytes, policy, hit_threshold)
        self.url = url
        self.timeout = timeout
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.prefix = prefix.encode()
        self.base_backoff = backoff
        self.max_backoff = max_backoff
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._lock = threading.Lock()
        self._state = "up"
        self._backoff = backoff
        self._retry_at = 0.0
        self._used_memory = 0
        self.last_error: str | None = None

    # -- health ------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def _available(self) -> bool:
        with self._lock:
            return self._state == "up" or time.monotonic() >= self._retry_at

    def _ok(self) -> None:
        if self._state != "up":
            with self._lock:
                old, self._state = self._state, "up"
                self._backoff = self.base_backoff
            if old != "up":
                self._log_state(old, "up")

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.last_error = f"{type(exc).__name__}: {exc}"
            # Only a failed probe (a call let through after the backoff) doubles it: calls that
            # were already in flight on other threads when the server went away fail too, and
            # must not push the next probe out by a power of two each.
            in_flight = self._state == "down" and now < self._retry_at
            went_down = self._state == "up"
            if not in_flight:
                if self._state == "down":
                    self._backoff = min(self._backoff * 2, self.max_backoff)
                self._state = "down"
                self._retry_at = now + self._backoff
        if went_down:
            self._log_state("up", "down")
        self.stats.add(errors=1)
        with contextlib.suppress(Exception):  # dropping dead sockets must not raise
            self._client.connection_pool.disconnect()

    def _call(self, fn, default):
        if not self._available():
            return default
        try:
            out = fn()
        except self._errors as e:
            self._failed(e)
            return default
        self._ok()
        return out

    def ping(self) -> bool:
        """Probe the server now (ignores the backoff); updates ``state``."""
        try:
            self._client.ping()
        except self._errors as e:
            self._failed(e)
            return False
        self._ok()
        return True

    # -- Tier API ----------------------------------------------------------------------------
    def _k(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    @property
    def used_bytes(self) -> int:
        """Redis's ``used_memory`` as last read by ``server_info()`` (0 before; no network here).
        The whole server's figure: other prefixes and other processes' blocks count too."""
        return self._used_memory

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(n) for n in pipe.execute()]

        found = self._call(run, [False] * len(keys))
        self.stats.add(queries=len(found), hits=sum(found))
        return found

    def put(self, key: bytes, value: bytes) -> bool:
        size = len(value)
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            self.stats.add(store_rejected=1)
            return False
        ok = self._call(lambda: self._client.set(self._k(key), value, px=self.ttl_ms), False)
        if not ok:
            self.stats.add(store_rejected=1)
            return False
        self.stats.add(stores=1, bytes_stored=size)
        return True

    def get(self, key: bytes) -> bytes | None:
        t0 = time.perf_counter()
        self.stats.add(loads=1)
        value = self._call(lambda: self._client.get(self._k(key)), None)
        if value is None:
            return None
        self.stats.add(load_hits=1, bytes_loaded=len(value))
        self.stats.record_load_latency(time.perf_counter() - t0)
        return value

    def delete(self, key: bytes) -> None:
        self._call(lambda: self._client.delete(self._k(key)), 0)

    def clear(self) -> None:
        """Delete every key under this tier's prefix (other prefixes on the server are left alone)."""

        def run():
            batch = []
            for k in self._client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)
            return True

        self._call(run, False)

    def server_info(self) -> dict[str, Any]:
        """Redis's own memory figures (empty while down)."""
        info = self._call(lambda: self._client.info(), {})
        keys = ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "keyspace_hits", "keyspace_misses")
        out = {k: info[k] for k in keys if k in info}
        self._used_memory = out.get("used_memory", self._used_memory)
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()
