"""Automatic segment reuse (``segment_reuse="auto"``, issue 24): shared content found in any
prompt, with no markup.

* **Chunks.** Every prompt is cut into content-defined chunks (``cache/chunking.py``: a
  rolling hash over token ids, hard cuts after chat-template special tokens and blank lines),
  so the same text chunks the same way wherever it appears.
* **Index, fed by every prefill.** When a prompt's KV is complete (an ordinary prefill's
  last chunk, or a blend), each chunk of at least :data:`MIN_CHUNK` tokens that the segment
  store lacks is copied from the pool into it, keyed by (namespace, model, dtype, tokens):
  the store of marked segments (``blend/store.py``; so chunks live in the tiers as segments
  do, and a cache salt keeps tenants apart there as everywhere). The engine does it once the
  step that completed the prompt is out, off its first token's path (``blend/engine_hook.py``).
* **Lookup.** A newly admitted prompt takes its prefix hit first; then every chunk that starts
  at or after the hit and is in the store is a candidate. With at least :data:`MIN_REUSE`
  tokens found, the prompt is blended (``Blender.prefill``: moved by RoPE, the most deviating
  tokens recomputed); otherwise it runs as an ordinary prefill, bit for bit as with auto off.
  A prompt that differs from a cached one early (a timestamp) is the same mechanism at shift
  0: its later chunks are found at their own positions and repaired (item 2).
* **Context means.** A stored chunk's tokens computed again in another context join its stored KV, a
  per-token mean over the contexts (``SegmentKVStore.fold``): a chunk of an ordinary prefill that the
  store holds already, and the reused chunks' tokens a blend recomputes (``Blender.prefill``). With
  ``contexts`` above 1 (``auto_reuse_contexts``) a moved chunk is reused only once it was computed in that
  many contexts; until then a prompt computes it in full (and folds it in). A chunk found in place
  (after the same tokens, within :data:`IN_PLACE` positions: behind an early edit) is reused at once.
* **Guard.** ``blend/guard.py`` bounds the drift estimate per request: the blend recomputes
  the most deviating reused tokens until the estimate is within the bound, and a result still
  above it falls back to a full prefill of the uncertain part.

Invariants: nothing is stored or looked up across namespaces (the store's key holds the cache
salt and adapter); chunks are stored, and folded into their context means, only from KV this
engine computed for them (exact, or computed in full beside reused neighbours, as CacheBlend stores
segments), never from KV that was itself reused; a prompt with marked segments is left to the
marked path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.chunking import ChunkRule, break_tokens, chunk_spans
from .blender import Blender, BlendOptions
from .guard import guard
from .prompt import SegmentSpan
from .store import SegmentKVStore

MIN_CHUNK = 8  # chunks shorter than this are neither stored nor looked up
MIN_REUSE = 32  # found tokens below which a prompt is an ordinary prefill
# A chunk found after the tokens it was computed after and at most this many positions away is in place
# (an early edit): reused without waiting for ``contexts``. A reordered document moves by whole documents.
IN_PLACE = 16
# Reused tokens deviating at most this above the KV's own rounding (auto_floor) at the check layer
# are never recomputed (BlendOptions.floor): a chunk found at its own position behind a small edit
# (a timestamp) deviates ~1e-4 past the first tokens after the edit in float32, a reordered document
# ~1e-2 (benchmarks/auto_reuse.py).
AUTO_FLOOR = 0.005


def auto_floor(kv_dtype: torch.dtype) -> float:
    """:data:`AUTO_FLOOR` above the deviation that rounding alone gives a KV computed twice, one unit
    roundoff of its dtype: in bfloat16 the tokens behind a timestamp edit deviate 0.0040 (median;
    0.0076 at the 99th percentile) where float32's deviate 0.0003, and recomputing them changed
    nothing but the reuse (BENCHMARKS.md, issue 24)."""
    return AUTO_FLOOR + torch.finfo(kv_dtype).eps / 2


def rule_for(tokenizer) -> ChunkRule:
    """The chunk rule for a tokenizer: its special tokens and newline tokens are the breaks."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials.update(i for i, tok in added.items() if getattr(tok, "special", False))
    ids = sorted(set(tokenizer.get_vocab().values()))
    texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    hard, soft = break_tokens(dict(zip(ids, texts)), specials)
    return ChunkRule(hard=hard, soft=soft)


@dataclass
class AutoStats:
    requests: int = 0  # prompts answered with automatically reused KV
    tokens: int = 0  # reused tokens kept in those prompts' KV
    fallbacks: int = 0  # prompts the guard sent back to a full prefill of the uncertain part
    repairs: int = 0  # prompts whose recompute grew beyond the ratio to meet the guard's bound
    repaired_tokens: int = 0  # the reused tokens so recomputed
    stored_chunks: int = 0


@dataclass(frozen=True)
class AutoResult:
    logits: torch.Tensor
    num_reused_tokens: int
    drift: float
    fell_back: bool
    exact_until: int
    num_repaired_tokens: int  # recomputed beyond the ratio to meet the bound (guard.py)
    folds: list  # the reused tokens recomputed, for harvest(folds=...) (BlendResult.folds)


class AutoReuse:
    def __init__(self, blender: Blender, store: SegmentKVStore, rule: ChunkRule, contexts: int = 1) -> None:
        """``contexts``: how many contexts a chunk is computed in, in full, before it is reused."""
        self.blender, self.store, self.rule, self.contexts = blender, store, rule, contexts
        self.stats = AutoStats()

    def chunks(self, token_ids: list[int]) -> list[SegmentSpan]:
        """The prompt's chunks of at least :data:`MIN_CHUNK` tokens."""
        return [SegmentSpan(a, b) for a, b in chunk_spans(token_ids, self.rule) if b - a >= MIN_CHUNK]

    def plan(self, token_ids: list[int], start: int, salt: str | None,
             adapter: str | None) -> tuple[SegmentSpan, ...] | None:
        """The stored chunks at or after ``start`` (the prefix hit) worth blending (:meth:`_ready`), or None."""
        found = tuple(c for c in self.chunks(token_ids)
                      if c.start >= start and c.end < len(token_ids) and self._ready(token_ids, c, salt, adapter))
        return found if sum(c.num_tokens for c in found) >= MIN_REUSE else None

    def _ready(self, token_ids: list[int], chunk: SegmentSpan, salt: str | None, adapter: str | None) -> bool:
        """Whether ``chunk`` is stored and computed in at least ``contexts`` contexts, or found in place: after
        the same tokens and at most :data:`IN_PLACE` positions from where it was computed (cache repair: an
        early edit, a name of another length; its KV is this context's but for edits further left, and a
        mean over contexts would add nothing)."""
        hit = self.store.get(token_ids[chunk.start : chunk.end], salt, adapter)
        if hit is None:
            return False
        entry = hit[0]
        if self.contexts <= 1 or self.store.contexts_of(entry.key) >= self.contexts:
            return True
        return abs(entry.origin - chunk.start) <= IN_PLACE and entry.left == self.store.left_digest(token_ids, chunk.start)

    def prefill(self, token_ids: list[int], spans: tuple[SegmentSpan, ...], slots: torch.Tensor, start: int,
                opts: BlendOptions, bound: float, salt: str | None, adapter: str | None) -> AutoResult:
        """Blend ``spans`` (from :meth:`plan`) into the prompt and guard it. Storing what it computed
        is :meth:`harvest`'s (``reused=spans``, ``computed_from=start``, the result's ``folds``), once the
        prompt's first token is out."""
        last = [len(token_ids) - 1]
        res = self.blender.prefill(token_ids, spans, slots, start, opts, salt, adapter, last, fold=True)
        verdict = guard(self.blender.model, self.blender.kv, token_ids, slots, res, bound, last)
        if res.num_repaired_tokens:
            self.stats.repairs += 1
            self.stats.repaired_tokens += res.num_repaired_tokens
        if verdict.fell_back:
            self.stats.fallbacks += 1
        elif verdict.num_reused_tokens:
            self.stats.requests += 1
            self.stats.tokens += verdict.num_reused_tokens
        return AutoResult(verdict.logits, verdict.num_reused_tokens, verdict.drift, verdict.fell_back,
                          verdict.exact_until, res.num_repaired_tokens, res.folds)

    def harvest(self, token_ids: list[int], slots: torch.Tensor, salt: str | None, adapter: str | None,
                reused: tuple[SegmentSpan, ...] = (), computed_from: int = 0, folds: list = ()) -> int:
        """Store the chunks of a prompt whose KV is complete at ``slots`` that the store lacks, and fold
        those it holds into their context means (``SegmentKVStore.fold``) where this prompt computed them:
        not inside its prefix hit (before ``computed_from``: a context the cache saw already), nor the
        ``reused`` ones (a blend's: their KV here is mostly the stored one; ``folds``, from
        ``BlendResult.folds``, are what it recomputed of them). One gather from the pool for what is
        stored, one for what is folded; returns how many chunks were stored."""
        skip = set(reused)
        missing, folds = [], list(folds)
        for c in self.chunks(token_ids):
            if c in skip:
                continue
            tokens = token_ids[c.start : c.end]
            key = self.store.key(tokens, salt, adapter)
            if key not in self.store.index:
                missing.append(c)
            elif c.start >= computed_from and (entry := self.store.index.peek(key, tokens)) is not None:
                folds.append((c, entry, torch.arange(c.start, c.end)))
        self.blender.fold(folds, slots)
        if not missing:
            return 0
        kvt = self.blender.read(slots[torch.cat([torch.arange(c.start, c.end) for c in missing])])  # one gather
        stored, at = 0, 0
        for c in missing:
            stored += self.store.put(token_ids[c.start : c.end], salt, adapter, c.start,
                                     kvt[:, :, at : at + c.num_tokens], left=self.store.left_digest(token_ids, c.start))
            at += c.num_tokens
        self.stats.stored_chunks += stored
        return stored
