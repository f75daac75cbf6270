"""How a model's layers share the KV pool: one group per run of layers with one attention type.

A model whose layers all attend the whole context has one group holding every layer, and a
block is all layers' KV for ``block_size`` tokens (the classic layout). A model with
sliding-window layers (Mistral: all of them; Gemma 2: every other; Gemma 3: five of six) keeps
the windowed layers' KV in groups of their own, whose blocks are given back once every query
still to come lies past them (docs/ARCHITECTURE.md, "Hybrid KV layout"), as vLLM's hybrid KV
cache manager does.

Layout (vLLM's): every group holds the same number of layers, ``page_layers`` (the smallest
count of any attention type), so that one pool of equal pages serves all groups and the
bytes a group holds follow from the pages it holds. An attention type with ``n`` layers gets
``ceil(n / page_layers)`` groups; the last may leave page rows unused. Layer ``l`` lives in
row ``row_of[l]`` of the pages of group ``group_of[l]``.

Invariants: every layer is in exactly one group; a group's layers share one window (None:
full attention); full-attention groups come first, so group 0 is a full group whenever the
model has one (its blocks are named by the plain chain hash, which routers compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV lives in one group's blocks; ``window`` None means full attention."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        """As vLLM's KV events name a group's spec (``kv_cache_spec_kind``)."""
        return "full_attention" if self.window is None else "sliding_window"


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    page_layers: int  # layers per page (block): rows of the pool's buffer

    @classmethod
    def full(cls, num_layers: int) -> KVLayout:
        """One group, every layer, no window: blocks are kept for the whole context."""
        return cls((KVGroup(None, tuple(range(num_layers))),), num_layers)

    @classmethod
    def plan(cls, windows: Sequence[int | None]) -> KVLayout:
        """The hybrid layout for per-layer windows (None: full attention); the classic one
        when no layer has a window."""
        if not any(w is not None for w in windows):
            return cls.full(len(windows))
        by_type: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            by_type.setdefault(w, []).append(layer)
        size = min(len(v) for v in by_type.values())
        order = sorted(by_type, key=lambda w: (w is not None, w or 0))  # full first
        groups = [KVGroup(w, tuple(by_type[w][i : i + size])) for w in order for i in range(0, len(by_type[w]), size)]
        return cls(tuple(groups), size)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether any group gives blocks back (has a window)."""
        return any(g.window is not None for g in self.groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return tuple(out)

    @property
    def row_of(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for group in self.groups:
            for row, layer in enumerate(group.layers):
                out[layer] = row
        return tuple(out)

    def pages_for(self, num_blocks: int) -> int:
        """Pages that take the memory of ``num_blocks`` blocks of the classic layout."""
        return max(1, num_blocks * self.num_layers // self.page_layers)

    def first_live_block(self, group: int, num_computed: int, block_size: int) -> int:
        """The first block of ``group`` that a query at position ``num_computed`` or later can
        still see: a window ``W`` query at ``p`` sees keys ``p - W < j <= p``, so blocks wholly
        before ``num_computed - W + 1`` are never read again (0 for full groups)."""
        w = self.groups[group].window
        return 0 if w is None else max(0, num_computed - w + 1) // block_size
