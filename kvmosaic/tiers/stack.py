"""TierStack: the tiers below the pool, fastest first, and the one place values are checked.

- ``lookup(keys)`` answers, for a chain of block hashes, which tier holds each block of the
  longest contiguous prefix found (the fastest tier that has it); it stops at the first block no
  tier holds, as a chain lookup must (a block is valid only behind its exact history).
- ``load(key, expected)`` gets the value from the fastest tier that has it and decodes it against
  the expected :class:`~kvmosaic.tiers.format.BlockMeta`. Invariant: a payload is returned only
  if every format check passes; a value that fails one is counted in that tier's
  ``stats.corrupt`` (by reason), deleted from that tier, and the next tier is tried — wrong KV is
  never returned (tests/test_tiers_stack.py, tests/test_tiers_redis.py).
- ``store(key, meta, payload, trigger, hits)`` encodes and writes to each tier whose policy
  wants the block on that trigger (see base.Policy); ``put_block`` to given tiers.

Who may write (format.py): with a ``secret`` (``--kv-tier-secret``, the same on every replica)
every value carries an HMAC-SHA256 under a key derived from it and every load verifies it; a
value without a valid MAC ("forged"), or whose payload the ``payload_check`` hook rejects
(the engine's: non-finite values, "nonfinite"), is treated as corrupt: counted, deleted, a miss.
Without a secret, host tiers use a per-process random key (only this process writes them) and
disk and Redis tiers are checksum-only: they trust every writer, and building such a stack logs
a warning saying so.

Byte accounting of every tier stays exact under any sequence of these calls
(tests/test_tiers_stack.py::TierStackMachine). See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Tier, Trigger
from .format import BlockMeta, CorruptEntry, TierKeys, decode_block_meta, encode_block

logger = logging.getLogger("kvmosaic.tiers")

#: Shared tiers: another process may write them, so only a shared secret authenticates them.
SHARED_MEDIA = ("disk", "redis")
#: The MAC key of host tiers without a secret: nobody outside this process writes them.
_PROCESS_KEY = secrets.token_bytes(32)

#: ``payload_check(stored_meta, payload)``: a reason (e.g. "nonfinite") to reject, or None.
PayloadCheck = Callable[[BlockMeta, bytes], "str | None"]


@dataclass(frozen=True)
class Loaded:
    """A verified block: its KV bytes and the tier (index into the stack, and medium) it came from."""

    payload: bytes
    tier: int
    medium: str
    position: int = 0  # the stored meta's position (a segment's origin)
    left: bytes = b""  # the stored meta's left-context digest (a segment's)


class TierStack:
    def __init__(self, tiers: Sequence[Tier] = (), secret: bytes | str | None = None,
                 payload_check: PayloadCheck | None = None) -> None:
        self.tiers: list[Tier] = list(tiers)
        seen: set[str] = set()
        for i, t in enumerate(self.tiers):  # names key the stats: keep them unique
            if t.name in seen:
                t.name = f"{t.name}{i}"
            seen.add(t.name)
        keys = TierKeys.from_secret(secret) if secret is not None else None
        self.authenticated = keys is not None
        self.token_key: bytes | None = keys.tokens if keys is not None else None
        # Per tier: the MAC key its values carry and its loads require (None: checksum only).
        self.mac_keys: list[bytes | None] = [
            keys.mac if keys is not None else (None if t.medium in SHARED_MEDIA else _PROCESS_KEY)
            for t in self.tiers
        ]
        self.payload_check = payload_check
        shared = [t.name for t, k in zip(self.tiers, self.mac_keys) if k is None]
        if shared:
            logger.warning("storage tier(s) %s: entries are unauthenticated (checksum only; any process that "
                           "can write the directory or the Redis server can change the KV this engine "
                           "loads); set --kv-tier-secret or --kv-tier-secret-file on every replica", shared)

    def __len__(self) -> int:
        return len(self.tiers)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __getitem__(self, i: int) -> Tier:
        return self.tiers[i]

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """For each key, the index of the fastest tier holding it; None from the first key that
        no tier holds onward (so ``result.index(None)`` is the prefix length, when present)."""
        found: list[int | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers):
            pending = [j for j, t in enumerate(found) if t is None]
            if not pending:
                break
            for j, hit in zip(pending, tier.contains_many([keys[j] for j in pending])):
                if hit:
                    found[j] = i
        if None in found:
            first = found.index(None)
            found[first:] = [None] * (len(found) - first)
        return found

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        found = self.lookup(keys)
        return found.index(None) if None in found else len(found)

    # -- load --------------------------------------------------------------------------------
    def load(self, key: bytes, expected: BlockMeta, tier: int | None = None) -> Loaded | None:
        """The verified payload of block ``key`` from tier ``tier`` (or the fastest that has it),
        falling through to slower tiers on a miss or a corrupt entry; None if none has it whole."""
        if not expected.block_hash:
            expected = dataclasses.replace(expected, block_hash=key)
        for i in range(tier or 0, len(self.tiers)):
            t = self.tiers[i]
            value = t.get(key)
            if value is None:
                continue
            try:
                meta, payload = decode_block_meta(value, expected, self.mac_keys[i], self.token_key)
                if self.payload_check is not None:
                    why = self.payload_check(meta, payload)
                    if why:
                        raise CorruptEntry(why)
                return Loaded(payload, i, t.medium, meta.position, meta.left)
            except CorruptEntry as e:
                t.stats.record_corrupt(e.reason)
                t.delete(key)
                t._removed([key])
        return None

    # -- store -------------------------------------------------------------------------------
    def store(
        self,
        key: bytes,
        meta: BlockMeta,
        payload: bytes | bytearray | memoryview,
        trigger: Trigger | str = Trigger.FULL,
        hits: int = 0,
    ) -> list[int]:
        """Write the block to every tier whose policy wants it on ``trigger``; returns their indices.

        A selective tier that already holds the block is skipped (a hit must not rewrite it)."""
        trigger = Trigger(trigger)
        targets = [i for i, t in enumerate(self.tiers) if t.wants(trigger, hits)]
        if trigger is Trigger.HIT:
            targets = [i for i in targets if not self.tiers[i].contains(key)]
        if not targets:
            return []
        return self.put_block(key, meta, payload, targets)

    def encode(self, key: bytes, meta: BlockMeta, payload: bytes | bytearray | memoryview, tier: int) -> bytes:
        """The value tier ``tier`` stores for this block (its MAC key, the stack's token key)."""
        if meta.block_hash != key:
            meta = dataclasses.replace(meta, block_hash=key)
        return encode_block(meta, payload, self.mac_keys[tier], self.token_key)

    def put_block(self, key: bytes, meta: BlockMeta, payload: bytes | bytearray | memoryview,
                  tiers: Sequence[int]) -> list[int]:
        """Encode the block (once per distinct MAC key) and write it to ``tiers``; the indices stored."""
        values: dict[bytes | None, bytes] = {}
        stored = []
        for i in tiers:
            k = self.mac_keys[i]
            if k not in values:
                values[k] = self.encode(key, meta, payload, i)
            if self.tiers[i].put(key, values[k]):
                stored.append(i)
        return stored

    def put_encoded(self, key: bytes, value: bytes, tiers: Sequence[int]) -> list[int]:
        """Write an already encoded value as is (it must carry the MAC each tier checks)."""
        return [i for i in tiers if self.tiers[i].put(key, value)]

    # -- housekeeping ------------------------------------------------------------------------
    def delete(self, key: bytes) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier (by name): its counters, medium, policy, state (and the error while not "up"),
        used and capacity bytes, and whether its entries are authenticated (a MAC on every value)."""
        out = {}
        for t, k in zip(self.tiers, self.mac_keys):
            s = t.stats.snapshot()
            state = t.state
            s.update(medium=t.medium, policy=t.policy.value, state=state,
                     error=None if state == "up" else t.last_error,
                     used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes, authenticated=k is not None)
            out[t.name] = s
        return out

    def close(self) -> None:
        for t in self.tiers:
            t.close()
