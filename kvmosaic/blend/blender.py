"""Segment reuse for one prompt, as the engine calls it once the prompt's blocks exist.

:meth:`Blender.prefill` fills the pool with KV for every prompt token and returns logits:

* tokens before ``start`` are a prefix-cache hit and are left alone;
* each segment is looked up in the segment store by content (and salt, adapter, model,
  dtype). A missing one is computed behind the prompt's head (the tokens before the first
  segment, whose KV is exact) and stored: a segment computed behind a shared system prompt
  deviates half as much when reused as one computed alone;
* stored KV is written at the segment's new positions (K re-rotated, V as is), then
  :func:`~kvmosaic.blend.forward.blend_forward` recomputes what the mode asks for.

Modes: ``shift`` recomputes only the non-segment tokens; ``blend`` also recomputes the reused
tokens whose early-layer KV deviates most (a ratio, or all above a threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.paged import PagedKVCache
from ..model.attention import AttentionMetadata, PrefillSpan
from ..model.llama import LlamaForCausalLM
from .forward import blend_forward
from .prompt import SegmentSpan
from .rope import rerotate
from .select import choose
from .store import SegmentKVStore

MODES = ("off", "shift", "blend")
SELECTIONS = ("deviation", "random")


@dataclass
class BlendOptions:
    mode: str = "blend"
    ratio: float = 0.15
    threshold: float | None = None  # when set, overrides ratio
    check_layer: int = 1
    selection: str = "deviation"  # "random" is the baseline the scores must beat
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"segment_reuse must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.ratio}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"blend_threshold must be non-negative, got {self.threshold}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"blend selection must be one of {SELECTIONS}, got {self.selection!r}")


@dataclass
class BlendResult:
    logits: torch.Tensor  # [len(logits_positions), vocab]
    num_segment_tokens: int  # served from the store and not recomputed
    num_stored_tokens: int  # segment tokens computed here and added to the store
    num_recomputed_segment_tokens: int  # store hits recomputed anyway


class Blender:
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, store: SegmentKVStore) -> None:
        self.model, self.kv, self.store = model, kv, store
        cfg = model.config
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta

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
    ) -> BlendResult:
        """``slots`` ``[len(token_ids)]``: where each token's KV goes; those before ``start``
        hold a prefix hit (read only). Logits default to the last token's."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = logits_positions if logits_positions is not None else [n - 1]
        head = spans[0].start if spans else n
        found, missing = [], []
        for span in spans:
            if span.end <= start:
                continue  # inside the prefix hit: exact already
            hit = self.store.get(token_ids[span.start : span.end], cache_salt, adapter_id)
            if hit is None:
                missing.append(span)
            else:
                found.append((span, hit[0].origin, hit[1]))
        hits = torch.zeros(n, dtype=torch.bool)
        for span, _, _ in found:
            hits[span.start : span.end] = True
        if missing:
            if start < head:
                self._exact(ids, slots, start, head)
                start = head
            found += self._compute_behind_head(ids, slots, start, head, missing, cache_salt, adapter_id)
        reused = self._place(found, slots, start, n)
        reused[positions] = False
        pick = None
        if opts.mode == "blend":
            gen = torch.Generator().manual_seed(opts.seed)
            pick = lambda s: choose(s, opts.ratio, opts.threshold, opts.selection == "random", gen)  # noqa: E731
        out = blend_forward(self.model, self.kv, ids, slots, start, reused, torch.tensor(positions), pick,
                            opts.check_layer)
        kept = hits & reused & ~out.recomputed
        return BlendResult(out.logits, int(kept.sum()), int((reused & ~hits).sum()),
                           int((hits & reused & out.recomputed).sum()))

    # ---- steps ---------------------------------------------------------------------------
    def _forward(self, ids, positions, slot_map, spans: list[PrefillSpan]) -> None:
        """Write KV only (no logits) for a packed batch of prefill spans."""
        dev = self.kv.device
        spans = [PrefillSpan(s.start, s.end, s.ctx_slots.to(dev), None if s.mask is None else s.mask.to(dev))
                 for s in spans]
        meta = AttentionMetadata(slot_map.to(dev), spans)
        self.model(ids.to(dev), positions.to(dev), self.kv, meta, torch.empty(0, dtype=torch.long, device=dev))

    def _exact(self, ids, slots, start: int, end: int) -> None:
        """Plain prefill of tokens ``start .. end-1`` behind the pool's exact ``< start``."""
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None] if start else None
        self._forward(ids[start:end], torch.arange(start, end), slots[start:end],
                      [PrefillSpan(0, end - start, slots[:end], mask)])

    def _compute_behind_head(self, ids, slots, start, head, spans, salt, adapter):
        """Compute each missing segment at positions ``head ..`` behind the head, using the
        prompt's own slots from ``start`` on as scratch, and store it. Segments that do not
        fit in the scratch stay unreused (computed in full by the blend pass)."""
        scratch = slots[start:]
        batch, used = [], 0
        for span in spans:
            if used + span.num_tokens > scratch.numel():
                break
            batch.append((span, scratch[used : used + span.num_tokens]))
            used += span.num_tokens
        if not batch:
            return []
        head_slots = slots[:head]
        tok, pos, packed, t = [], [], [], 0
        for span, scr in batch:
            m = span.num_tokens
            tok.append(ids[span.start : span.end])
            pos.append(torch.arange(head, head + m))
            causal = torch.ones(m, m, dtype=torch.bool).tril()
            mask = torch.cat((torch.ones(m, head, dtype=torch.bool), causal), dim=1) if head else None
            packed.append(PrefillSpan(t, t + m, torch.cat((head_slots, scr)), mask))
            t += m
        self._forward(torch.cat(tok), torch.cat(pos), scratch[:used], packed)
        out = []
        for span, scr in batch:
            kvt = self._read(scr)
            self.store.put(ids[span.start : span.end].tolist(), salt, adapter, head, kvt)
            out.append((span, head, kvt))
        return out

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        """KV at ``slots``, every layer: ``[L, 2, T, kv_heads, head_dim]``."""
        s = slots.to(self.kv.device)
        return torch.stack([torch.stack((k.index_select(0, s), v.index_select(0, s)))
                            for k, v in zip(self.kv.k, self.kv.v)])

    def _place(self, found, slots, start: int, n: int) -> torch.Tensor:
        """Write stored KV (``found``: span, origin, tensor) at the segments' positions from
        ``start`` on; returns ``reused``, the tokens so written."""
        reused = torch.zeros(n, dtype=torch.bool)
        ks, vs, dst = [], [], []
        for span, origin, kvt in found:
            lo = max(span.start, start)
            part = kvt[:, :, lo - span.start :]
            ks.append(rerotate(part[:, 0], span.start - origin, self.head_dim, self.theta))
            vs.append(part[:, 1])
            dst.append(slots[lo : span.end])
            reused[lo : span.end] = True
        if dst:
            k, v, s = torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(dst).to(self.kv.device)
            for layer in range(len(self.kv.k)):
                self.kv.write(layer, s, k[layer], v[layer])
        return reused
