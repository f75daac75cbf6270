"""Segment KV tensors, kept by :class:`~kvmosaic.cache.segments.SegmentIndex`.

Each stored segment is one tensor ``[num_layers, 2 (K, V), T, kv_heads, head_dim]`` in the
KV pool's dtype, K rotated at positions ``origin .. origin+T-1`` (the index entry records
``origin``). A tensor is held exactly as long as its key is in the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.hashing import CacheNamespace
from ..cache.segments import SegmentEntry, SegmentIndex, segment_key


class SegmentKVStore:
    def __init__(self, capacity_bytes: int, seed: bytes) -> None:
        self.index = SegmentIndex(capacity_bytes)
        self.seed = seed
        self.tensors: dict[bytes, torch.Tensor] = {}

    def key(self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None) -> bytes:
        return segment_key(CacheNamespace(self.seed, cache_salt, adapter_id), tokens)

    def get(
        self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None = None
    ) -> tuple[SegmentEntry, torch.Tensor] | None:
        entry = self.index.lookup(self.key(tokens, cache_salt, adapter_id), tokens)
        return None if entry is None else (entry, self.tensors[entry.key])

    def put(
        self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None, origin: int, kv: torch.Tensor
    ) -> bool:
        """Keep ``kv`` (copied) for ``tokens``; False when it is larger than the budget."""
        key = self.key(tokens, cache_salt, adapter_id)
        evicted = self.index.insert(key, tokens, origin, kv.numel() * kv.element_size())
        if evicted is None:
            return False
        for old in evicted:
            self.tensors.pop(old, None)
        self.tensors[key] = kv.clone()
        return True

    def clear(self) -> None:
        self.index.clear()
        self.tensors.clear()

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes
