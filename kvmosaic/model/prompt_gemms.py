"""Which GEMM computes a projection's prompt rows: oneDNN's packed one or the tile unit's.

Where the fused decode step's projections are on the tile unit (an AMX CPU in bfloat16:
``decode_tiles.amx_blocks``), every packed projection keeps two copies of its weight: oneDNN's packed
one and the step's B tiles, so either can compute a span of prompt rows (``PackedLinear.onednn_product``,
``tile_product``: decode_step.c's ``gemm_amx``). oneDNN's bfloat16 GEMM on this model's narrow
projections runs at a speed that jumps with the exact row count (on a 2-core AMX Xeon the QKV projection
of 30 layers: 10.4 ms at 650 rows, 16.1 at 649, 9.8 at 651, 16.4 at 745), while the tile GEMM's grows
with the rows; over its wide gate/up projection oneDNN's is the faster at every count, and past ~1,000
rows its narrow ones catch up (``python -m benchmarks.prompt_gemms``; BENCHMARKS.md, issue 26,
eleventh session). So a span of ``TILE_ROWS`` rows of a projection with at most ``TILE_MAX_OUT``
outputs takes the tile GEMM: from 257 to 1,024 rows the shipped model's QKV, output and down
projections together 4-30 ms faster over 30 layers (a 648-token prefill ~130 against ~155 ms).

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
TILE_ROWS = (257, 1024)  # spans of these row counts (inclusive) take the tile GEMM
TILE_MAX_OUT = 1024  # ... in projections with at most this many outputs
ALL_ROWS = (1, 1 << 62)


def choose(model: nn.Module) -> int:
    """Set ``tile_rows`` of every packed projection of ``model`` whose weight is in the step's tile layout;
    returns how many take the tile GEMM for some spans."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "onednn", "tiles"):
        raise ValueError(f"{ENV}={mode!r}: expected 'onednn' or 'tiles'")
    count = 0
    for module in model.modules():
        if type(module) is not PackedLinear or not on_tiles(module):
            continue
        if mode:
            module.tile_rows = ALL_ROWS if mode == "tiles" else None
        else:
            module.tile_rows = TILE_ROWS if module.out_features <= TILE_MAX_OUT else None
        count += module.tile_rows is not None
    return count


def on_tiles(module: PackedLinear) -> bool:
    """Whether ``module``'s kept weight is the tile unit's B tiles (the fused step's layout there), which
    ``tile_product`` reads."""
    return module._in_step_layout and decode_tiles.step_layout(module.kept.dtype) == decode_tiles.AMX
