"""Which GEMM computes a projection's prompt rows: oneDNN's packed one or the tile unit's.

Where the fused decode step's projections are on the tile unit (an AMX CPU in bfloat16:
``decode_tiles.amx_blocks``), every packed projection keeps two copies of its weight: oneDNN's packed
one and the step's B tiles, so either can compute a span of prompt rows (``PackedLinear.onednn_product``,
``tile_product``: decode_step.c's ``gemm_amx_blocks``). Two costs decide between them (``python -m
benchmarks.prompt_gemms``; BENCHMARKS.md, issue 26, eleventh to fourteenth sessions, a 2-core AMX Xeon):

- oneDNN builds its kernel for each row count it meets: the first product at a new count costs 1.2-1.5 ms
  more per projection kind at ~130 rows and 3-4.5 ms at 420-750 (the tile GEMM has no per-shape code), and
  a server meets new counts all the time (prompt lengths, and the decode rows beside a prompt's, vary);
- the tile GEMM finishes each block of outputs (rounding, or SiLU . up) while it sums the next, so its
  narrow projections (QKV, output, down) match or beat oneDNN's up to a few thousand rows (over 30 layers at
  1,500 rows 61 against 75 ms, at 2,048 82 against 83; in another run 4,096 158 against 151), and gate/up with
  SiLU . up in its epilogue beats oneDNN's product then ``silu_mul`` at every count (745 rows 32 against 45 ms,
  2,048 84 against 100);
- oneDNN's plain gate/up product: the tile GEMM's leads it up to ~1,024 rows (745 rows 29 against 35 ms over
  30 layers, since each pass over the blocks takes as many rows as L2 keeps: fourteenth session), oneDNN's
  past them (2,048 rows 71 against 82).

So every span of the projections with at most ``TILE_MAX_OUT`` outputs takes the tile GEMM (``TILE_ROWS``),
and so does every span of gate/up where the layer's activation is SiLU (``PackedLinear.silu_product``); a
plain wide product (another activation) takes it for ``WIDE_TILE_ROWS`` and oneDNN's past them, called with
zero rows added up to one of a few dozen counts (``PackedLinear.padded_rows``: a span of 1,500 rows as 1,536),
so that a server builds oneDNN's kernel for a count once and meets it again. A SiLU model's prompt thus
computes every row on its own at any length (the tile GEMM and the row kernels do): its rows are the same
bits at any count, from the cache or not.

The rule is fixed, not measured per process: a span's row count alone decides its product, so a prompt
gives the same bits in every process on the same CPU (a measured choice followed the measurement's noise
near ties). ``KVMOSAIC_PROMPT_GEMMS=onednn|tiles`` overrides it for every span (for measuring);
docs/ARCHITECTURE.md, "On the tile unit".
"""

from __future__ import annotations

import os

from torch import nn

from . import decode_tiles
from .packed_linear import PackedLinear

ENV = "KVMOSAIC_PROMPT_GEMMS"
ALL_ROWS = (1, 1 << 62)
TILE_ROWS = ALL_ROWS  # spans of these row counts (inclusive) take the tile GEMM ...
TILE_MAX_OUT = 1024  # ... in projections with at most this many outputs
WIDE_TILE_ROWS = (1, 1024)  # ... and spans of these in the wider ones' plain product


def choose(model: nn.Module) -> int:
    """Set ``tile_rows`` and ``padded_rows`` of every packed projection of ``model`` whose weight is in the
    step's tile layout; returns how many take the tile GEMM for some spans."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "onednn", "tiles"):
        raise ValueError(f"{ENV}={mode!r}: expected 'onednn' or 'tiles'")
    count = 0
    for module in model.modules():
        if type(module) is not PackedLinear or not on_tiles(module):
            continue
        if mode:
            module.tile_rows, module.padded_rows = (ALL_ROWS if mode == "tiles" else None), False
        else:
            module.tile_rows = TILE_ROWS if module.out_features <= TILE_MAX_OUT else WIDE_TILE_ROWS
            module.padded_rows = True
        count += module.tile_rows is not None
    return count


def on_tiles(module: PackedLinear) -> bool:
    """Whether ``module``'s kept weight is the tile unit's B tiles (the fused step's layout there), which
    ``tile_product`` reads."""
    return module._in_step_layout and decode_tiles.step_layout(module.kept.dtype) == decode_tiles.AMX
