"""Segment reuse for one prompt, as the engine calls it once the prompt's blocks exist.

:meth:`Blender.prefill` fills the pool with KV for every prompt token and returns logits:

* tokens before ``start`` are a prefix-cache hit and are left alone;
* each segment is looked up in the segment store by content (and salt, adapter, model,
  dtype). A stored one is written at its new positions (K re-rotated, V as is);
* :func:`~kvmosaic.blend.forward.blend_forward` then computes every other token in full and
  recomputes what the mode asks for among the reused ones;
* each segment that was missing is stored afterwards, with the KV it got in this prompt: KV
  "computed for a chunk in one context" (CacheBlend). A segment computed among its real
  neighbours deviates far less when moved than one computed alone or behind the head only,
  and a request whose segments are all new is an exact full prefill;
* with ``fold`` (automatic reuse), the result lists the reused tokens recomputed here (not a moved
  chunk's head) for the caller to fold into their chunks' stored means over contexts once the step is
  out (:attr:`BlendResult.folds`, :meth:`Blender.fold`, ``blend/store.py``).

Modes: ``shift`` recomputes only the non-segment tokens; ``blend`` also recomputes the reused
tokens whose early-layer KV deviates most (a ratio, or all above a threshold), or those
weighted by how much the answer reads them (``selection``: auto reuse's default). In both, the first ``head`` tokens
of a segment that no longer follows the tokens it was stored after are recomputed
(``SegmentEntry.left``); docs/ARCHITECTURE.md, "Automatic segment reuse".

Positions before the first reused token that kept its moved KV are exact (they only attend
to exact tokens); :attr:`BlendResult.exact_until` says where that ends, so that the prefix
cache may index what is exact and nothing after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.segments import SegmentEntry
from ..kv.paged import PagedKVCache
from ..model import kernels
from ..model.llama import LlamaForCausalLM
from .forward import Picker, blend_forward
from .prompt import SegmentSpan
from .rope import rerotate, shift_tables
from .select import attention_weights, choose, drift_estimate, within_drift
from .store import SegmentKVStore

MODES = ("off", "shift", "blend", "auto")  # auto: blend, and chunks found without markup (auto.py)
# deviation: CacheBlend's (the reused tokens whose check-layer KV deviates most); attention: the
# same weighted by how much the answer reads each token there (select.attention_weights); random:
# the baseline both must beat
SELECTIONS = ("attention", "deviation", "random")


@dataclass
class BlendOptions:
    mode: str = "blend"
    ratio: float = 0.15
    threshold: float | None = None  # when set, overrides ratio
    check_layer: int = 2
    selection: str = "deviation"  # see SELECTIONS
    seed: int = 0
    floor: float = 0.0  # with a ratio: never recompute a token whose deviation is at most this
    # The first tokens of every reused segment that does not follow the tokens it was computed
    # after are recomputed (EPIC's "LegoLink": a chunk whose start moved away from its first
    # context is where the attention it draws is off most; one that still continues the same
    # text, as the later chunks of a moved document do, is not).
    head: int = 0
    # The guard's bound (auto reuse): beyond the ratio, recompute the most deviating reused tokens
    # until the drift estimate of those kept (BlendResult.drift) is at most this (None: no bound)
    max_drift: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"segment_reuse must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.ratio}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"blend_threshold must be non-negative, got {self.threshold}")
        if self.check_layer < 1:
            raise ValueError(f"blend_check_layer must be at least 1, got {self.check_layer}")
        if self.head < 0:
            raise ValueError(f"blend_head_tokens must be non-negative, got {self.head}")
        if self.max_drift is not None and not self.max_drift >= 0:
            raise ValueError(f"auto_reuse_max_drift must be non-negative, got {self.max_drift}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"blend selection must be one of {SELECTIONS}, got {self.selection!r}")


@dataclass
class BlendResult:
    logits: torch.Tensor  # [len(logits_positions), vocab]
    num_segment_tokens: int  # served from the store and not recomputed
    num_stored_tokens: int  # segment tokens computed here and added to the store
    num_recomputed_segment_tokens: int  # store hits recomputed anyway
    exact_until: int  # KV of positions below this equals a full prefill's
    # The cheap drift estimate the auto-reuse guard bounds (blend/guard.py): the check-layer
    # deviation scores of the reused tokens kept (not recomputed), averaged over at most
    # select.DRIFT_SPAN of them (select.drift_estimate); 0.0 when none was kept or nothing was
    # scored (shift).
    drift: float = 0.0
    # The same deviations weighted by the last prompt token's attention to them at the check
    # layer (sum over the kept tokens): how much of what the answer reads is off.
    drift_attn: float = 0.0
    # Reused tokens recomputed beyond the ratio to bring ``drift`` within ``BlendOptions.max_drift``
    num_repaired_tokens: int = 0
    # With ``fold``: (span, its store entry, the prompt positions in it recomputed here), for Blender.fold
    folds: list = field(default_factory=list)


@dataclass
class Placement:
    """What :meth:`Blender.place` wrote: ``reused`` ``[len(token_ids)]``, the tokens whose KV is now a
    stored segment's and that the pass may keep (not the first ``head`` of a moved segment, nor a logits
    position); ``found``, the spans placed with their store entries; ``missing``, those the store lacks."""

    reused: torch.Tensor
    found: list[tuple[SegmentSpan, SegmentEntry]]
    missing: list[SegmentSpan]


def picker(opts: BlendOptions, repaired: list[int]) -> Picker:
    """The recompute choice ``opts`` asks for (blend/select.py); appends to ``repaired`` how many
    tokens the bound added to it."""
    gen = torch.Generator().manual_seed(opts.seed)

    def pick(scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        weights = attention_weights(attention) if opts.selection == "attention" else None
        idx = choose(scores, opts.ratio, opts.threshold, opts.selection == "random", gen, opts.floor, weights)
        if opts.max_drift is None:
            return idx
        extra = within_drift(scores.float().cpu(), idx, opts.max_drift)
        repaired.append(extra.numel())
        return torch.cat((idx, extra)).sort().values

    return pick


class Blender:
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, store: SegmentKVStore) -> None:
        self.model, self.kv, self.store = model, kv, store
        self.inv_freq = model.rotary.inv_freq.detach().cpu()  # the model's own RoPE (blend/rope.py)
        self.pools = kernels.pool_rows(kv.k, kv.v)  # None: the pool is not the placing kernel's

    def prefill(
        self,
        token_ids: list[int],
        spans: tuple[SegmentSpan, ...],
        slots: torch.Tensor,
        start: int,
        opts: BlendOptions,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        logits_positions: list[int] | None = None,
        fold: bool = False,
    ) -> BlendResult:
        """``slots`` ``[len(token_ids)]``: where each token's KV goes; those before ``start``
        hold a prefix hit (read only). Logits default to the last token's. With ``fold`` (automatic
        reuse, once per request), :attr:`BlendResult.folds` lists the reused tokens recomputed here, which
        :meth:`fold` joins to their chunks' context means."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = logits_positions if logits_positions is not None else [n - 1]
        placed = self.place(token_ids, spans, slots, start, opts.head, positions, cache_salt, adapter_id)
        reused = placed.reused
        repaired: list[int] = []
        pick = picker(opts, repaired) if opts.mode in ("blend", "auto") and reused.any() else None
        out = blend_forward(self.model, self.kv, ids, slots, start, reused, torch.tensor(positions), pick,
                            opts.check_layer)
        stored = 0
        for span in placed.missing:  # stored with the KV this prompt gave it
            kvt = self.read(slots[span.start : span.end])
            if self.store.put(token_ids[span.start : span.end], cache_salt, adapter_id, span.start, kvt,
                              left=self.store.left_digest(token_ids, span.start)):
                stored += span.num_tokens
        folds = []
        if fold:  # the reused tokens this context recomputed (a moved chunk's head is recomputed every time)
            chosen = reused & out.recomputed
            for span, entry in placed.found:
                at = torch.arange(max(span.start, start), span.end)
                folds.append((span, entry, at[chosen[at]]))
        kept = reused & ~out.recomputed
        inexact = kept.nonzero()
        scored = out.deviation is not None and bool(kept.any())
        drift = drift_estimate(out.deviation[kept]) if scored else 0.0
        drift_attn = float((out.deviation * out.attention)[kept].sum()) if scored else 0.0
        return BlendResult(out.logits, int(kept.sum()), stored, int((reused & out.recomputed).sum()),
                           int(inexact[0]) if inexact.numel() else n, drift, drift_attn, sum(repaired), folds)

    def place(self, token_ids: list[int], spans: tuple[SegmentSpan, ...], slots: torch.Tensor, start: int,
              head: int, logits_positions: list[int], cache_salt: str | None = None,
              adapter_id: str | None = None) -> Placement:
        """The first step of :meth:`prefill`: write every stored segment of ``spans`` (from ``start`` on)
        at its positions (see :class:`Placement`)."""
        found, missing = [], []
        for span in spans:
            if span.end <= start:
                continue  # inside the prefix hit: exact already
            hit = self.store.get(token_ids[span.start : span.end], cache_salt, adapter_id)
            if hit is None:
                missing.append(span)
            else:
                found.append((span, hit[0], hit[1]))
        reused = self._place(found, slots, start, len(token_ids))
        if head:
            for span, entry, _ in found:  # computed in full, as the tokens around the segments are
                if entry.left != self.store.left_digest(token_ids, span.start):  # None: not known, moved
                    reused[max(span.start, start) : min(span.start + head, span.end)] = False
        reused[logits_positions] = False
        return Placement(reused, [(span, entry) for span, entry, _ in found], missing)

    def fold(self, folds: list[tuple[SegmentSpan, SegmentEntry, torch.Tensor]], slots: torch.Tensor) -> None:
        """For each (span, its store entry, prompt positions inside the span): fold the KV now at those
        positions' ``slots`` (computed in this prompt's context) into the entry's stored means
        (``SegmentKVStore.fold``), K moved from the span's positions to the entry's own; an entry the store
        no longer holds (evicted or stored again since) is passed over. One gather from the pool and one
        re-rotation for all of them."""
        folds = [f for f in folds if f[2].numel() and self.store.index.peek(f[1].key, f[1].tokens) is f[1]]
        if not folds:
            return
        positions = torch.cat([p for _, _, p in folds])
        deltas = torch.cat([torch.full((p.numel(),), entry.origin - span.start) for span, entry, p in folds])
        kvt = self.read(slots[positions])
        kvt = torch.stack((rerotate(kvt[:, 0], deltas, self.inv_freq), kvt[:, 1]), dim=1)
        self.store.fold([(entry.key, p - span.start) for span, entry, p in folds], kvt)

    # ---- steps ---------------------------------------------------------------------------
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """KV at ``slots``, every layer: ``[L, 2, T, kv_heads, head_dim]``."""
        s = slots.to(self.kv.device)
        first = self.kv.k[0]
        out = first.new_empty(len(self.kv.k), 2, s.numel(), *first.shape[1:])
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            torch.index_select(k, 0, s, out=out[layer, 0])  # gathered once, into place
            torch.index_select(v, 0, s, out=out[layer, 1])
        return out

    def _place(self, found, slots, start: int, n: int) -> torch.Tensor:
        """Write stored KV (``found``: span, entry, tensor) at the segments' positions from
        ``start`` on; returns ``reused``, the tokens so written. Each segment in one pass where
        the kernel serves (``kernels.rerotate_store``), else re-rotated and written by torch ops:
        the same values."""
        reused = torch.zeros(n, dtype=torch.bool)
        deltas = [span.start - entry.origin for span, entry, _ in found]
        cos, signed_sin = shift_tables(torch.tensor(deltas, dtype=torch.long), self.inv_freq)  # [segments, rot]
        ks, vs, dst = [], [], []
        for i, (span, _, kvt) in enumerate(found):
            lo = max(span.start, start)
            part, to = kvt[:, :, lo - span.start :], slots[lo : span.end]
            reused[lo : span.end] = True
            if self.pools is None or not kernels.rerotate_store(part, cos[i], signed_sin[i], to, self.pools):
                ks.append(rerotate(part[:, 0], deltas[i], self.inv_freq))
                vs.append(part[:, 1])
                dst.append(to)
        if dst:
            k, v, s = torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(dst).to(self.kv.device)
            for layer in range(len(self.kv.k)):
                self.kv.write(layer, s, k[layer], v[layer])
        return reused
