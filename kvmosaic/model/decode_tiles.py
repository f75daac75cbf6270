"""The layout in which the fused decode step reads its weights (float32 and bfloat16): decode tiles,
interleaved or not.

The step (``kernels/decode_step.c``) computes a projection a tile of ``channels`` output rows at
a time. In row order the tile's rows are read side by side, ``channels`` streams a thread (each
prefetched by hand); interleaved, the same ``channels * in`` elements are interleaved by ``lanes``
(one vector load), so that the tile is one sequential stream for the hardware prefetcher. Which
reads closer to the memory bandwidth depends on the CPU (``interleave``). A tile covers the same
span of the tensor in both layouts, and the step forms the same products in the same order: a
result does not depend on the layout.

Invariant: ``from_tiles(to_tiles(w))`` equals ``w``; both are pure permutations (no rounding).
``channels`` and ``lanes`` come from the compiled library (``lanes``: the weight's elements in one
of the CPU's vectors, so per dtype). The layout is chosen once per process: weights converted at
load (``to_step_layout``) and the step's ``tiled`` argument agree.
"""

from __future__ import annotations

import ctypes
import functools
import os

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


LAYOUT_ENV = "KVMOSAIC_DECODE_LAYOUT"  # "tiles" or "rows": overrides the CPU's default (for measuring)


def cpu_vendor() -> str:
    """The CPU's vendor id (``AuthenticAMD``, ``GenuineIntel``), or "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


@functools.cache
def interleave() -> bool:
    """Whether the fused step reads its dense weights interleaved (True) or in rows (False) in this
    process. An AMD EPYC's prefetcher follows one stream a tile better: interleaved, ~1.5x the read
    rate in bfloat16 (Zen 4), 10-15% in float32 (AVX2 Zen 3); an AMX Xeon reads the rows, prefetched
    by hand, at 30 against 20 GB/s in bfloat16 and 32 against 28 in float32 (``benchmarks.decode_layout``;
    BENCHMARKS.md, issue 26, eighth session). ``KVMOSAIC_DECODE_LAYOUT=tiles|rows`` overrides."""
    chosen = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if chosen not in ("", "tiles", "rows"):
        raise ValueError(f"{LAYOUT_ENV}={chosen!r}: expected 'tiles' or 'rows'")
    return chosen == "tiles" if chosen else cpu_vendor() == "AuthenticAMD"


def to_step_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``tileable``) in the layout the fused step reads in this process: ``to_tiles(w)``, or
    ``w`` itself where the step reads rows."""
    return to_tiles(w) if interleave() else w


def from_step_layout(t: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` rows of ``t``, a weight in the step's layout (``to_step_layout``)."""
    return from_tiles(t) if interleave() else t


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
    """A bias-free linear layer over a weight kept in the fused step's layout only
    (``to_step_layout``: decode tiles, interleaved where this CPU reads them faster), computed by
    the step's C product (``linear_rows``): every row of the input on its own, so a row's result
    does not depend on the others (oneDNN's bfloat16 GEMM changes a row's result past 32 rows).
    The LM head: at one or a few rows it reads the tiles at the memory bandwidth (bfloat16 on a Zen
    4 EPYC: 1.1-1.5 ms against 1.7-2.1 for oneDNN's packed head); at dozens of rows it is slower
    than oneDNN's GEMM (~1.2-1.5x), which only prompt log-probabilities ask of a head. It replaces
    the packed copy, so the memory is the same. ``weight``: the rows (a copy where interleaved)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("tiles", to_step_layout(weight.detach()), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return from_step_layout(self.tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_product(self.tiles, x)


def rows_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in ``weight``'s dtype, where ``weight`` is ``w`` ``[out, in]`` in the fused step's
    layout (``to_step_layout``): the step's C product (``linear_rows``), every row of ``x`` on its
    own, as the step's projections and its head compute them."""
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features).to(weight.dtype).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=weight.dtype)
    rc = kernels.decode_step_library().linear_rows(
        weight.data_ptr(), in_features, out_features, int(interleave()), rows.data_ptr(), rows.shape[0],
        out.data_ptr(), int(weight.dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"linear_rows failed (code {rc})")
    return out.view(*lead, out_features)


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
