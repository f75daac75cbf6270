"""TierStack: the tiers below the pool, fastest first, and the one place values are checked.

- ``lookup(keys)`` answers, for a chain of block hashes, which tier holds each block of the
  longest contiguous prefix found (the fastest tier that has it); it stops at the first block no
  tier holds, as a chain lookup must (a block is valid only behind its exact history).
- ``load(key, expected)`` gets the value from the fastest tier that has it and decodes it against
  the expected :class:`~kvmosaic.tiers.format.BlockMeta`. Invariant: a payload is returned only
  if every format check passes; a value that fails one is counted in that tier's
  ``stats.corrupt`` (by reason), deleted from that tier, and the next tier is tried — wrong KV is
  never returned (tests/test_tiers_stores.py, tests/test_tiers_redis.py).
- ``store(key, meta, payload, trigger, hits)`` encodes once and writes to each tier whose policy
  wants the block on that trigger (see base.Policy).

Byte accounting of every tier stays exact under any sequence of these calls
(tests/test_tiers_stores.py::TierStackMachine). See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Tier, Trigger
from .format import BlockMeta, CorruptEntry, decode_block_meta, encode_block


@dataclass(frozen=True)
class Loaded:
    """A verified block: its KV bytes and the tier (index into the stack, and medium) it came from."""

    payload: bytes
    tier: int
    medium: str
    position: int = 0  # the stored meta's position (a segment's origin)


class TierStack:
    def __init__(self, tiers: Sequence[Tier] = ()) -> None:
        self.tiers: list[Tier] = list(tiers)
        seen: set[str] = set()
        for i, t in enumerate(self.tiers):  # names key the stats: keep them unique
            if t.name in seen:
                t.name = f"{t.name}{i}"
            seen.add(t.name)

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
                meta, payload = decode_block_meta(value, expected)
                return Loaded(payload, i, t.medium, meta.position)
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
        if meta.block_hash != key:
            meta = dataclasses.replace(meta, block_hash=key)
        value = encode_block(meta, payload)
        return [i for i in targets if self.tiers[i].put(key, value)]

    def put_encoded(self, key: bytes, value: bytes, tiers: Sequence[int]) -> list[int]:
        """Write an already encoded value (e.g. promoting a loaded block to a faster tier)."""
        return [i for i in tiers if self.tiers[i].put(key, value)]

    # -- housekeeping ------------------------------------------------------------------------
    def delete(self, key: bytes) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier (by name): its counters, medium, policy, state, used and capacity bytes."""
        out = {}
        for t in self.tiers:
            s = t.stats.snapshot()
            s.update(medium=t.medium, policy=t.policy.value, state=t.state,
                     used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes)
            out[t.name] = s
        return out

    def close(self) -> None:
        for t in self.tiers:
            t.close()
