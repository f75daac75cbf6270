"""Which GEMM computes a projection's prompt rows: oneDNN's packed one or the tile unit's, chosen by measuring both.

Where the fused decode step's projections are on the tile unit (an AMX CPU in bfloat16:
``decode_tiles.amx_blocks``), every packed projection keeps two copies of its weight: oneDNN's packed
one and the step's B tiles. Either can compute a span of prompt rows: ``torch.ops.mkldnn`` or the
step's tile GEMM (``linear_amx``, decode_step.c's ``gemm_amx``). Neither wins everywhere, and oneDNN's
speed jumps with the row count: on a 2-core AMX Xeon at this model's shapes, 649 rows of the QKV
projection took 17.1 ms (30 layers) with oneDNN and 10.1 with the tile GEMM, 1,500 rows 19.0 against
21.5; its gate/up projection was faster with oneDNN at every count (BENCHMARKS.md, issue 26, eleventh
session). So each distinct projection shape is timed once per process, both ways, at one row count per
half-octave bucket from 257 to 2,048 rows, and a span takes the tile GEMM where that was faster by
``MARGIN`` in its bucket. Below 257 rows the two differ by a few percent either way (a choice there
would be the measurement's noise, and with it a row's bits from one process to the next) and past 2,048
the tile GEMM loses: oneDNN's product there.

Invariant: the choice depends on the row count only, fixed for the process once made, so the same span
is computed the same way whenever it recurs. ``KVMOSAIC_PROMPT_GEMMS=onednn|tiles`` overrides it (for
measuring); docs/ARCHITECTURE.md, "On the tile unit".
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch import nn

from . import decode_tiles
from .packed_linear import EDGES, PackedLinear

ENV = "KVMOSAIC_PROMPT_GEMMS"
MARGIN = 0.9  # the tile GEMM's time at most this share of oneDNN's to take a bucket
REPEATS = 3
_picks: dict[tuple[int, int, int], tuple[bool, ...]] = {}  # (out, in, threads): measured once per process


def choose(model: nn.Module) -> int:
    """Give every packed projection of ``model`` whose weight is in the step's tile layout its buckets'
    choice (``PackedLinear.tile_buckets``); returns how many projections take the tile GEMM somewhere."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "onednn", "tiles"):
        raise ValueError(f"{ENV}={mode!r}: expected 'onednn' or 'tiles'")
    count = 0
    for module in model.modules():
        if type(module) is not PackedLinear or not _on_tiles(module):
            continue
        key = (module.out_features, module.in_features, torch.get_num_threads())
        if mode:
            picks = (mode == "tiles",) * (len(EDGES) - 1)
        else:
            picks = _picks[key] if key in _picks else _picks.setdefault(key, _measured(module))
        module.tile_buckets = picks if any(picks) else None
        count += module.tile_buckets is not None
    return count


def _on_tiles(module: PackedLinear) -> bool:
    return module._in_step_layout and decode_tiles.step_layout(module.kept.dtype) == decode_tiles.AMX


def _measured(module: PackedLinear) -> tuple[bool, ...]:
    """Per bucket, whether the tile GEMM beat oneDNN's by ``MARGIN`` on ``module`` (the first projection of
    its shape at this thread count: the others take its result), best of ``REPEATS`` interleaved runs at
    the bucket's geometric middle."""
    gen = torch.Generator().manual_seed(0)
    picks = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        x = torch.randn(round(math.sqrt(lo * hi)), module.in_features, generator=gen).to(module.kept.dtype)
        tile, onednn = [], []
        for _ in range(REPEATS):
            tile.append(_seconds(module.tile_product, x))
            onednn.append(_seconds(module.onednn_product, x))
        picks.append(min(tile) < MARGIN * min(onednn))
    return tuple(picks)


def _seconds(product, x: torch.Tensor) -> float:
    start = time.perf_counter()
    product(x)
    return time.perf_counter() - start
