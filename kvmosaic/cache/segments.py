"""The segment index: names segments (documents) by content and namespace, and decides which
to keep under a byte budget. Bookkeeping only; the KV tensors live in ``blend/store.py``.

A segment key is ``hash(namespace, tokens)`` where the :class:`CacheNamespace` folds in what
makes KV incompatible: model fingerprint, KV dtype (its seed), cache salt and adapter id. It does *not* depend on
the segment's position or on the tokens before it, which is what lets a document be found
again wherever it appears; the blend step corrects for the changed context.

Invariants:

* two keys are equal only if tokens, salt, adapter, model and dtype all are (up to hash
  collisions, which ``tokens`` kept in each entry let a caller rule out);
* ``used_bytes <= capacity_bytes`` after every insert; eviction is least recently used
  (``lookup`` and ``insert`` both count as a use);
* an entry larger than the whole budget is never admitted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2

from .hashing import CacheNamespace

SegmentKey = bytes
# Tokens before a segment that its entry remembers: a segment found again right after the same
# tokens continues the text it was computed in (blend/blender.py: no head recompute there).
LEFT_CONTEXT = 16


def segment_seed(model_fingerprint: str, kv_dtype: str) -> bytes:
    """The seed of every segment namespace of one engine: model identity and KV dtype (not
    the block size: a segment is stored by token, wherever its blocks fall)."""
    return hashlib.sha256(cbor2.dumps(["kvmosaic-segment-v1", model_fingerprint, kv_dtype])).digest()


def segment_key(namespace: CacheNamespace, tokens: Sequence[int]) -> SegmentKey:
    """A segment's name: its tokens in a namespace (salt and adapter taint it)."""
    payload = [namespace.seed, namespace.cache_salt, namespace.adapter_id, list(tokens)]
    return hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()


@dataclass
class SegmentEntry:
    """A stored segment: ``tokens`` were computed at positions ``origin .. origin+len-1``,
    right after the tokens whose digest is ``left`` (the last up-to-:data:`LEFT_CONTEXT` tokens
    before it there, ``SegmentKVStore.left_digest`` in blend/store.py; None: not known)."""

    key: SegmentKey
    tokens: tuple[int, ...]
    origin: int
    nbytes: int
    left: bytes | None = None


@dataclass
class SegmentStats:
    """``lookups`` and ``hits`` in tokens; ``inserts`` and ``evictions`` in entries."""

    lookups: int = 0
    hits: int = 0
    inserts: int = 0
    evictions: int = 0


class SegmentIndex:
    """LRU map from key to :class:`SegmentEntry` under ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.entries: OrderedDict[SegmentKey, SegmentEntry] = OrderedDict()
        self.stats = SegmentStats()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self.entries

    def lookup(self, key: SegmentKey, tokens: Sequence[int]) -> SegmentEntry | None:
        """The entry for ``key`` if its tokens match (a use: it becomes most recent)."""
        self.stats.lookups += len(tokens)
        entry = self.entries.get(key)
        if entry is None or entry.tokens != tuple(tokens):
            return None
        self.entries.move_to_end(key)
        self.stats.hits += len(tokens)
        return entry

    def peek(self, key: SegmentKey, tokens: Sequence[int]) -> SegmentEntry | None:
        """The entry for ``key`` if its tokens match, without counting a lookup or touching its recency."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.tokens == tuple(tokens) else None

    def insert(self, key: SegmentKey, tokens: Sequence[int], origin: int, nbytes: int,
               left: bytes | None = None) -> list[SegmentKey] | None:
        """Admit an entry, evicting least recently used ones to make room. Returns the
        evicted keys (the caller drops their tensors), or None when it cannot fit at all."""
        if nbytes > self.capacity_bytes:
            return None
        evicted = self.remove(key)
        while self.used_bytes + nbytes > self.capacity_bytes:
            old, _ = next(iter(self.entries.items()))
            evicted += self.remove(old)
            self.stats.evictions += 1
        self.entries[key] = SegmentEntry(key, tuple(tokens), origin, nbytes, left)
        self.used_bytes += nbytes
        self.stats.inserts += 1
        return evicted

    def remove(self, key: SegmentKey) -> list[SegmentKey]:
        entry = self.entries.pop(key, None)
        if entry is None:
            return []
        self.used_bytes -= entry.nbytes
        return [key]

    def clear(self) -> list[SegmentKey]:
        keys = list(self.entries)
        self.entries.clear()
        self.used_bytes = 0
        return keys
