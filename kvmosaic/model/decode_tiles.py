"""The layout in which the fused decode step reads its weights (float32 and bfloat16): decode tiles.

The step (``kernels/decode_step.c``) computes a projection a tile of ``channels`` output rows at
a time. In row order the tile's rows are read side by side, ``channels`` streams a thread; in
decode tiles the same ``channels * in`` elements are interleaved by ``lanes`` (one vector load),
so that the tile is one sequential stream, which the hardware prefetcher follows closer to the
memory bandwidth (BENCHMARKS.md, issue 26). A tile covers the same span of the tensor in both
layouts, and the step forms the same products in the same order: a result does not depend on
the layout.

Invariant: ``from_tiles(to_tiles(w))`` equals ``w``; both are pure permutations (no rounding).
``channels`` and ``lanes`` come from the compiled library (``lanes``: the weight's elements in one
of the CPU's vectors, so per dtype).
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels

DTYPES = (torch.float32, torch.bfloat16)


def tile_shape(dtype: torch.dtype = torch.float32) -> tuple[int, int] | None:
    """(channels, lanes) of this CPU's decode tiles of ``dtype`` weights, or None where the
    library has no fused step in that dtype."""
    lib = kernels.decode_step_library()
    if lib is None or dtype not in DTYPES:
        return None
    shape = (ctypes.c_int64 * 2)()
    return (int(shape[0]), int(shape[1])) if lib.decode_tile_shape(int(dtype == torch.bfloat16), shape) == 0 else None


def tileable(w: torch.Tensor) -> bool:
    shape = tile_shape(w.dtype)
    return (shape is not None and w.dim() == 2 and w.shape[0] % shape[0] == 0 and w.shape[1] % shape[1] == 0)


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """A new ``[out, in]`` tensor holding ``w`` in decode tiles (``tileable(w)`` must hold)."""
    channels, lanes = tile_shape(w.dtype)
    out, inp = w.shape
    return w.reshape(out // channels, channels, inp // lanes, lanes).transpose(1, 2).contiguous().view(out, inp)


def from_tiles(t: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` rows of decode tiles ``t`` (a new tensor)."""
    channels, lanes = tile_shape(t.dtype)
    out, inp = t.shape
    return t.reshape(out // channels, inp // lanes, channels, lanes).transpose(1, 2).contiguous().view(out, inp)
