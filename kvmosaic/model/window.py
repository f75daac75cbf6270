"""A step's attention metadata as a sliding-window layer (or a layer that cannot cascade) sees it.

The runner builds one :class:`~.attention.AttentionMetadata` per step for full attention. A
layer with window ``W`` lets the query at position ``p`` see keys at ``p - W < j <= p`` (as
transformers' ``sliding_window_overlay``); :func:`layer_view` derives that layer's metadata
from the step's, once per step and window, so that ``paged_attention`` needs no change:

* a prefill span keeps only the context its queries can see (from ``first query - W + 1``)
  and gets an explicit band mask; a span whose whole context lies inside every query's
  window is left as it is (the band does not bind);
* a decode row keeps the last ``W`` slots of its context;
* cascade groups (shared prefixes, attended once for several decodes) are dissolved: each row
  gets its whole context back (then windowed). Dissolving is exact: the prefix slots are the
  same memory either way.

Invariant: a prefill span's new tokens are its context's last tokens (the runner's spans
always are; segment reuse, whose spans are not, is refused for windowed models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata, DecodeBatch, PrefillSpan


@dataclass
class GroupedMetadata:
    """A step's metadata under a hybrid KV layout (``cache/kv_groups.py``): one
    :class:`AttentionMetadata` per layer group, built from that group's block tables, and
    the group of each layer. A window group's tables name page 0 for blocks given back; no
    query of a windowed layer reaches them (:func:`layer_view` keeps the window only)."""

    groups: list[AttentionMetadata]
    group_of: tuple[int, ...]

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.group_of[layer]]


def layer_view(meta: AttentionMetadata, window: int | None, bands: dict | None = None) -> AttentionMetadata:
    """``meta`` for a layer of window ``window`` (None: full attention) without cascade groups.
    ``bands``: a step's cache of band masks, which depend on positions only, so the layer groups
    of a hybrid KV layout (one metadata each) build each once."""
    if window is None and (meta.decode is None or not meta.decode.shared):
        return meta
    prefills = [_window_span(s, window, bands) for s in meta.prefills]
    decode = None if meta.decode is None else _window_decode(meta.decode, window)
    return AttentionMetadata(meta.slot_mapping, prefills, decode)


def _window_span(span: PrefillSpan, window: int | None, bands: dict | None = None) -> PrefillSpan:
    n = span.ctx_slots.numel()
    if window is None or n <= window:  # the last query sees back to position 0
        return span
    past = n - (span.end - span.start)
    first = max(0, past - window + 1)  # the first key any of the span's queries sees
    dev = span.ctx_slots.device
    key = (past, n, window, dev)
    mask = bands.get(key) if bands is not None else None
    if mask is None:
        q_pos = torch.arange(past, n, device=dev)[:, None]
        k_pos = torch.arange(first, n, device=dev)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        if bands is not None:
            bands[key] = mask
    return PrefillSpan(span.start, span.end, span.ctx_slots[first:], mask)


def _window_decode(d: DecodeBatch, window: int | None) -> DecodeBatch:
    b, width = d.ctx_slots.shape
    lens = d.mask.view(b, width).sum(1).tolist() if d.mask is not None else [width] * b
    rows = [d.ctx_slots[i, : lens[i]] for i in range(b)]
    for prefix in d.shared:
        for i in prefix.members.tolist():
            rows[i] = torch.cat((prefix.slots, rows[i]))
    if window is not None:
        rows = [r[-window:] for r in rows]
    lens_t = torch.tensor([r.numel() for r in rows], device=d.ctx_slots.device)
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = None
    if int(lens_t.min()) != padded.shape[1]:
        mask = (torch.arange(padded.shape[1], device=padded.device)[None, :] < lens_t[:, None])[:, None, None, :]
    return DecodeBatch(d.token_index, padded, mask, [], lens_t)
