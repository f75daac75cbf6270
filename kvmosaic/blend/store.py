"""Segment KV tensors, kept by :class:`~kvmosaic.cache.segments.SegmentIndex`.

Each stored segment is one tensor ``[num_layers, 2 (K, V), T, kv_heads, head_dim]`` in the
KV pool's dtype, K rotated at positions ``origin .. origin+T-1`` (the index entry records
``origin``). A tensor is held exactly as long as its key is in the index.

With storage tiers (``tiers``, given at construction; docs/ARCHITECTURE.md, "Storage tiers"), a
stored segment is also written to every tier under its segment key, in the tiers' checked
format (``layout`` ``segment:L,2,T,H,D``, a digest of the segment's tokens, ``position`` = origin), and a
segment missing from memory is looked up there: a restart or another process sharing a Redis
tier finds it. Tier I/O for segments runs on the engine thread
(a segment is stored once, when first computed); a load that fails a check is a miss.

**Context means** (automatic reuse, docs/ARCHITECTURE.md): a segment's tokens computed again in another
context fold into its tensor (:meth:`SegmentKVStore.fold`), which then holds, per token, the mean of the
KV of every context it was computed in (K aligned at ``origin`` first), up to :data:`FOLD_CAP` of them
(past it, each new context weighs ``1 / FOLD_CAP``). A new context's KV is nearer that mean than it is to
any one earlier context's (the spread of one context about the mean counts once instead of twice):
reordered RAG documents in plain text whose chunks were computed in two contexts drifted ~30% less (KL to
full prefill; no less in chat form: BENCHMARKS.md, issue 24). Folds are kept in memory; a tier holds the
segment as first stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.hashing import CacheNamespace
from ..cache.segments import LEFT_CONTEXT, SegmentEntry, SegmentIndex, segment_key
from ..kv.block_io import dtype_name, tensor_bytes
from ..kv.paged import PagedKVCache
from ..tiers import BlockMeta, TierStack, tokens_digest

SEGMENT_LAYOUT = "segment:L,2,T,H,D"
FOLD_CAP = 16  # contexts a token's stored KV averages before each new one weighs 1 / FOLD_CAP


class SegmentKVStore:
    def __init__(self, capacity_bytes: int, seed: bytes, tiers: TierStack | None = None, fingerprint: str = "",
                 kv: PagedKVCache | None = None) -> None:
        """``tiers`` (with the engine's ``fingerprint`` and ``kv`` pool, whose shape and dtype
        stored segments have): write stored segments there too and look there on a miss."""
        self.index = SegmentIndex(capacity_bytes)
        self.seed = seed
        self.tensors: dict[bytes, torch.Tensor] = {}
        self.contexts: dict[bytes, torch.Tensor] = {}  # [T] float32: contexts each token's KV is the mean of (absent: 1)
        self.tiers: TierStack | None = None
        self.token_key: bytes | None = None  # keys the left-context digests (the tiers' token key)
        self.fingerprint = ""
        self.tier_loads = 0  # segments found in a tier after a memory miss
        if tiers is not None:
            if kv is None:
                raise ValueError("a segment store with tiers needs the KV pool (its shape and dtype)")
            self.attach_tiers(tiers, fingerprint, kv)

    def attach_tiers(self, tiers: TierStack, fingerprint: str, kv: PagedKVCache) -> None:
        """Write stored segments to ``tiers`` too and look there on a memory miss."""
        self.tiers, self.fingerprint = tiers, fingerprint
        self.token_key = tiers.token_key
        self.layer_shape = (kv.config.num_layers, 2, kv.config.num_kv_heads, kv.config.head_dim)
        self.dtype, self.device = kv.dtype, kv.device

    def _meta(self, key: bytes, tokens: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype,
              origin: int = 0, left: bytes | None = None) -> BlockMeta:
        return BlockMeta(self.fingerprint, dtype_name(dtype), len(tokens), SEGMENT_LAYOUT, shape,
                         tuple(int(t) for t in tokens), key, position=origin, left=left or b"")

    def left_digest(self, token_ids: Sequence[int], start: int) -> bytes:
        """The digest a segment at ``start`` of ``token_ids`` records of the tokens before it: the
        last :data:`LEFT_CONTEXT` (all of them nearer the start, so their number counts too),
        keyed like the tiers' token digests, so that a tier holds no guessable digest of them."""
        return tokens_digest([int(t) for t in token_ids[max(0, start - LEFT_CONTEXT) : start]], self.token_key)

    def key(self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None) -> bytes:
        return segment_key(CacheNamespace(self.seed, cache_salt, adapter_id), tokens)

    def get(
        self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None = None
    ) -> tuple[SegmentEntry, torch.Tensor] | None:
        key = self.key(tokens, cache_salt, adapter_id)
        entry = self.index.lookup(key, tokens)
        if entry is not None:
            return entry, self.tensors[entry.key]
        return self._load_from_tiers(key, tokens, cache_salt, adapter_id)

    def _load_from_tiers(self, key: bytes, tokens: Sequence[int], cache_salt: str | None,
                         adapter_id: str | None) -> tuple[SegmentEntry, torch.Tensor] | None:
        if self.tiers is None:
            return None
        shape = (*self.layer_shape[:2], len(tokens), *self.layer_shape[2:])
        got = self.tiers.load(key, self._meta(key, tokens, shape, self.dtype))
        if got is None:
            return None
        kv = torch.frombuffer(bytearray(got.payload), dtype=self.dtype).view(shape).to(self.device)
        self.tier_loads += 1
        if not self.put(tokens, cache_salt, adapter_id, got.position, kv, to_tiers=False, left=got.left or None):
            return None
        return self.index.lookup(key, tokens), self.tensors[key]

    def put(
        self, tokens: Sequence[int], cache_salt: str | None, adapter_id: str | None, origin: int, kv: torch.Tensor,
        to_tiers: bool = True, left: bytes | None = None,
    ) -> bool:
        """Keep ``kv`` (copied) for ``tokens``, computed after the tokens whose
        :meth:`left_digest` is ``left``; False when it is larger than the budget."""
        key = self.key(tokens, cache_salt, adapter_id)
        if to_tiers and self.tiers is not None:
            meta = self._meta(key, tokens, tuple(kv.shape), kv.dtype, origin, left)
            payload = tensor_bytes(kv)
            self.tiers.put_block(key, meta, payload, range(len(self.tiers)))  # MAC'd per tier (format.py)
        evicted = self.index.insert(key, tokens, origin, kv.numel() * kv.element_size(), left)
        if evicted is None:
            return False
        for old in evicted:
            self.tensors.pop(old, None)
            self.contexts.pop(old, None)
        self.tensors[key] = kv.clone()
        return True

    def contexts_of(self, key: bytes) -> int:
        """How many contexts every token of the segment under ``key`` was computed in (1: as stored)."""
        counts = self.contexts.get(key)
        return 1 if counts is None else int(counts.min())

    def fold(self, parts: Sequence[tuple[bytes, torch.Tensor]], kv: torch.Tensor) -> None:
        """Fold KV computed in another context into stored segments: ``kv`` ``[L, 2, t, kv_heads,
        head_dim]`` holds, one part after the other, the KV of each part's segment (``key``) at its
        token ``offsets`` (ascending), K rotated at the segment's own positions (``origin + offsets``).
        Each token's stored KV becomes its running mean over its contexts (module docstring), for all
        parts at once; a key no longer stored is passed over."""
        live, take, at = [], [], 0
        for key, offsets in parts:
            if key in self.tensors and offsets.numel():
                live.append((key, offsets))
                take.append(torch.arange(at, at + offsets.numel()))
            at += offsets.numel()
        if not live:
            return
        counts = [self.contexts.setdefault(key, torch.ones(self.tensors[key].shape[2])) for key, _ in live]
        weight = 1.0 / (torch.cat([c[off] for c, (_, off) in zip(counts, live)]) + 1).clamp(max=FOLD_CAP)
        device = self.tensors[live[0][0]].device  # the pool's: the counts stay on the CPU
        on_device = [off.to(device) for _, off in live]
        mean = torch.cat([self.tensors[key].index_select(2, off) for (key, _), off in zip(live, on_device)], dim=2)
        new = kv.index_select(2, torch.cat(take).to(kv.device)) if len(take) < len(parts) else kv
        # lerp sums in float32 for bfloat16 inputs and rounds once, as the stored KV was rounded
        mean.lerp_(new.to(mean), weight.to(mean)[None, None, :, None, None])
        at = 0
        for (key, off), dev_off, c in zip(live, on_device, counts):
            self.tensors[key].index_copy_(2, dev_off, mean[:, :, at : at + off.numel()])
            c[off] += 1
            at += off.numel()

    def clear(self) -> None:
        self.index.clear()
        self.tensors.clear()
        self.contexts.clear()

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes
