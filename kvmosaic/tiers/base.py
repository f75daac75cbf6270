"""The interface every storage tier implements, and the write policies.

A tier maps a block's chain hash (``bytes``) to an encoded value (``bytes``, see format.py). It
stores bytes only: checking what comes back is the TierStack's job (stack.py).

Invariants each tier keeps (held by tests/test_tiers_host.py, test_tiers_disk.py and tests/test_tiers_redis.py):

- bounded: ``used_bytes <= capacity_bytes`` after every call (Redis bounds itself: maxmemory);
- a value is visible whole or not at all (no partial reads after a crash or an error);
- a failing medium costs misses, never exceptions: I/O and connection errors are counted in
  ``stats.errors`` and ``get`` returns None, ``put`` returns False;
- a failing medium says so: ``state`` leaves "up" ("failing" for a disk tier that lost or cannot
  write its directory, "down" for an unreachable Redis) with ``last_error``, and the change is
  logged once at WARNING, as is the recovery (/health and /metrics show ``state``).

See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from .stats import TierStats

logger = logging.getLogger("kvmosaic.tiers")


class Policy(str, enum.Enum):
    """When a block is written to a tier (SGLang HiCache's names).

    - ``write_back``: when the pool evicts the block (default for ``host``: RAM is cheap to fill
      late, and blocks still in the pool need no copy);
    - ``write_through``: as soon as the block is a full cached block (default for ``disk`` and
      ``redis``: a restart or another process finds it even if this one never evicts it);
    - ``write_through_selective``: write-through only for blocks hit at least ``hit_threshold``
      times (saves bandwidth on one-off prompts).
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"


class Trigger(str, enum.Enum):
    """What happened to a block in the pool; a tier's policy decides whether to store it."""

    FULL = "full"    # the block became a full, computed, cached block
    HIT = "hit"      # a request reused the block (with its running hit count)
    EVICT = "evict"  # the pool is evicting the block


DEFAULT_POLICY = {"host": Policy.WRITE_BACK, "disk": Policy.WRITE_THROUGH, "redis": Policy.WRITE_THROUGH}


def should_store(policy: Policy, trigger: Trigger, hits: int = 0, hit_threshold: int = 2) -> bool:
    if policy is Policy.WRITE_BACK:
        return trigger is Trigger.EVICT
    if policy is Policy.WRITE_THROUGH:
        return trigger is Trigger.FULL
    return trigger is not Trigger.EVICT and hits >= hit_threshold


class Tier(ABC):
    """A bounded key/value store for encoded KV blocks, with its own eviction order."""

    medium: str = ""
    last_error: str | None = None  # the error that took ``state`` out of "up"

    def __init__(
        self,
        name: str | None = None,
        capacity_bytes: int | None = None,
        policy: Policy | str | None = None,
        hit_threshold: int = 2,
    ) -> None:
        self.name = name or self.medium
        self.capacity_bytes = capacity_bytes
        self.policy = Policy(policy) if policy is not None else DEFAULT_POLICY[self.medium]
        self.hit_threshold = hit_threshold
        self.stats = TierStats()
        # Told of each key this tier drops on its own (its eviction order, a corrupt entry), so
        # cache events can say the block left this medium. Redis evicts by itself (maxmemory)
        # without telling: a follower may believe a Redis block is there until a load misses.
        self.on_removed: Callable[[bytes], None] | None = None

    def _removed(self, keys: Sequence[bytes]) -> None:
        if self.on_removed is not None:
            for key in keys:
                self.on_removed(key)

    def wants(self, trigger: Trigger, hits: int = 0) -> bool:
        """Whether this tier's policy stores a block on ``trigger``."""
        return should_store(self.policy, trigger, hits, self.hit_threshold)

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, this tier holds without a gap."""
        n = 0
        for found in self.contains_many(keys):
            if not found:
                break
            n += 1
        return n

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` whole under ``key`` (replacing any old one); False if refused or failed."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    @abstractmethod
    def clear(self) -> None: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    def state(self) -> str:
        """"up", or what is wrong: "down" (Redis unreachable), "failing" (disk I/O failing)."""
        return "up"

    def _log_state(self, old: str, new: str) -> None:
        """Say once that the tier's state changed (callers call this on a change only)."""
        if new == "up":
            logger.warning("storage tier %r (%s) is up again (was %s)", self.name, self.medium, old)
        else:
            logger.warning("storage tier %r (%s) is %s: %s; its loads are misses and its stores fail until it "
                           "recovers", self.name, self.medium, new, self.last_error)

    def close(self) -> None:
        """Release files, sockets and threads (the stored entries stay where they persist)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity_bytes={self.capacity_bytes}, policy={self.policy.value})"
