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
from torch import nn

from . import kernels

DTYPES = (torch.float32, torch.bfloat16)  # the fused decode step's dtypes


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


class TiledLinear(nn.Module):
    """A bias-free linear layer over a weight kept in decode tiles only, computed by the fused step's
    C product (``linear_rows``): every row of the input on its own, so a row's result does not
    depend on the others (oneDNN's bfloat16 GEMM changes a row's result past 32 rows). The LM
    head: at one or a few rows it reads the tiles at the memory bandwidth (bfloat16 on a Zen 4
    EPYC: 1.1-1.5 ms against 1.7-2.1 for oneDNN's packed head); at dozens of rows it is slower than
    oneDNN's GEMM (~1.2-1.5x), which only prompt log-probabilities ask of a head. It replaces the
    packed copy, so the memory is the same. ``weight`` rebuilds the rows (a copy)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("tiles", to_tiles(weight.detach()), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return from_tiles(self.tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(self.tiles.dtype).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=self.tiles.dtype)
        rc = kernels.decode_step_library().linear_rows(
            self.tiles.data_ptr(), self.in_features, self.out_features, 1, rows.data_ptr(), rows.shape[0],
            out.data_ptr(), int(self.tiles.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"linear_rows failed (code {rc})")
        return out.view(*lead, self.out_features)


def try_tiled(weight: torch.Tensor) -> TiledLinear | None:
    """A TiledLinear for ``weight`` where this CPU's C product serves it and gives what
    ``F.linear`` gives up to float32 summation order (checked on a few rows), else None."""
    if weight.device.type != "cpu" or not tileable(weight):
        return None
    layer = TiledLinear(weight)
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    got, want = layer(x).float(), nn.functional.linear(x, weight).float()
    rounding = 1e-5 if weight.dtype == torch.float32 else 2**-7  # a bfloat16 result: one step of rounding
    return layer if (got - want).abs().max() <= rounding * want.abs().max() else None
