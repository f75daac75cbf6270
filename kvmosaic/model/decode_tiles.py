"""The layout in which the fused decode step reads its weights (float32 and bfloat16): decode tiles,
interleaved or not, or the tile unit's blocks.

The step (``kernels/decode_step.c``) computes a projection a tile of ``channels`` output rows at
a time. In row order (``ROWS``) the tile's rows are read side by side, ``channels`` streams a thread
(each prefetched by hand); interleaved (``TILES``), the same ``channels * in`` elements are
interleaved by ``lanes`` (one vector load), so that the tile is one sequential stream for the
hardware prefetcher. Which reads closer to the memory bandwidth depends on the CPU (``interleave``).
A tile covers the same span of the tensor in both layouts, and the step forms the same products in
the same order: a result does not depend on which of the two.

On a CPU with AMX the step's bfloat16 projections run on the tile unit instead (``AMX``, where
``amx_blocks``): the weight is kept as the unit's B tiles, 16 output channels by 32 inputs each
(1 KB: the inputs in pairs), a block of 16 channels' tiles in order; the batch's rows are the A
tiles. Other products, and summed in another order than the vector ones; each row still on its own.

Invariant: ``from_layout(to_layout(w, layout, paired), layout, paired)`` equals ``w``; every conversion is a pure
permutation (no rounding). ``channels`` and ``lanes`` come from the compiled library (``lanes``: the
weight's elements in one of the CPU's vectors, so per dtype). The layouts are chosen once per
process: weights converted at load (``to_step_layout``) and the step's ``layout`` argument agree;
the C products row by row (the LM head: ``TiledLinear``, ``rows_product``) read ``head_layout()``.
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


LAYOUT_ENV = "KVMOSAIC_DECODE_LAYOUT"  # "tiles", "rows" or "amx": overrides the CPU's default (for measuring)
ROWS, TILES, AMX = 0, 1, 2  # the step's ``layout`` argument (decode_step.c's LAYOUT_*)
AMX_CHANNELS, AMX_INPUTS = 16, 32  # a B tile of the tile unit: output channels x inputs


def cpu_vendor() -> str:
    """The CPU's vendor id (``AuthenticAMD``, ``GenuineIntel``), or "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def _chosen() -> str:
    chosen = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if chosen not in ("", "tiles", "rows", "amx"):
        raise ValueError(f"{LAYOUT_ENV}={chosen!r}: expected 'tiles', 'rows' or 'amx'")
    return chosen


@functools.cache
def interleave() -> bool:
    """Whether the fused step reads its dense weights interleaved (True) or in rows (False) in this
    process. An AMD EPYC's prefetcher follows one stream a tile better: interleaved, ~1.5x the read
    rate in bfloat16 (Zen 4), 10-15% in float32 (AVX2 Zen 3); an AMX Xeon reads the rows, prefetched
    by hand, at 30 against 20 GB/s in bfloat16 and 32 against 28 in float32 (``benchmarks.decode_layout``;
    BENCHMARKS.md, issue 26, eighth session). ``KVMOSAIC_DECODE_LAYOUT=tiles|rows`` overrides."""
    chosen = _chosen()
    return chosen == "tiles" if chosen in ("tiles", "rows") else cpu_vendor() == "AuthenticAMD"


@functools.cache
def amx_blocks() -> bool:
    """Whether the fused step's bfloat16 projections run on the tile unit in this process: where the
    library was built with AMX and the OS grants the tile state. The four projections of 30 layers
    streamed at ~25 GB/s at 1 to 16 rows there, against ~17 for oneDNN's packed GEMMs; a one-row step
    is as fast as the vector step's (BENCHMARKS.md, issue 26, ninth session).
    ``KVMOSAIC_DECODE_LAYOUT=tiles|rows`` turns it off."""
    if _chosen() in ("tiles", "rows"):
        return False
    lib = kernels.decode_step_library()
    return lib is not None and lib.decode_step_amx() == 1


def head_layout() -> int:
    """The layout of the C products computed row by row (``TiledLinear``, ``rows_product``: the LM head)."""
    return TILES if interleave() else ROWS


def step_layout(dtype: torch.dtype) -> int:
    """The layout of the fused step's projections in ``dtype`` in this process."""
    return AMX if dtype == torch.bfloat16 and amx_blocks() else head_layout()


def to_layout(w: torch.Tensor, layout: int, paired: bool = False) -> torch.Tensor:
    """``w`` (``tileable`` in ``layout``) in ``layout``: a new tensor, or ``w`` itself for ``ROWS``.
    ``paired``: a gate/up projection (gate rows, then up rows; ``pairable``), whose decode tiles then
    alternate, gate tile t and up tile t side by side (``pair_halves``): the step reads both for each t,
    so they are one stream for the hardware prefetcher instead of two (a batch-1 bfloat16 step 3-4%
    faster in in-process A/Bs on a Zen 5 EPYC, float32 0.7%; BENCHMARKS.md, twentieth session). Only
    in ``TILES``: in rows and on the tile unit the step reads the halves as they are."""
    if paired and layout == TILES:
        w = pair_halves(w, tile_shape(w.dtype)[0])
    return to_amx(w) if layout == AMX else to_tiles(w) if layout == TILES else w


def from_layout(t: torch.Tensor, layout: int, paired: bool = False) -> torch.Tensor:
    """The ``[out, in]`` rows of ``t``, a weight in ``layout`` (``to_layout`` with the same ``paired``)."""
    rows = from_amx(t) if layout == AMX else from_tiles(t) if layout == TILES else t
    return unpair_halves(rows, tile_shape(t.dtype)[0]) if paired and layout == TILES else rows


def to_step_layout(w: torch.Tensor, paired: bool = False) -> torch.Tensor:
    """``w`` (``tileable``; ``pairable`` too where ``paired``) in the layout the fused step's projections
    read in this process (``to_layout``)."""
    return to_layout(w, step_layout(w.dtype), paired)


def from_step_layout(t: torch.Tensor, paired: bool = False) -> torch.Tensor:
    """The ``[out, in]`` rows of ``t``, a weight in the step's layout (``to_step_layout``, with the
    same ``paired``)."""
    return from_layout(t, step_layout(t.dtype), paired)


def pairable(w: torch.Tensor) -> bool:
    """Whether ``w``'s two halves split into whole tiles of the step's channels (``pair_halves``)."""
    shape = tile_shape(w.dtype)
    return shape is not None and w.dim() == 2 and w.shape[0] % (2 * shape[0]) == 0


def pair_halves(w: torch.Tensor, rows: int) -> torch.Tensor:
    """A new ``[2n, in]`` tensor: ``rows`` rows of the first half, then the same rows of the second,
    and so on (``w`` ``[2n, in]``, n a multiple of ``rows``)."""
    half = w.shape[0] // 2
    return w.reshape(2, half // rows, rows, w.shape[1]).transpose(0, 1).contiguous().view(w.shape)


def unpair_halves(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``pair_halves`` (a new tensor)."""
    half = t.shape[0] // 2
    return t.reshape(half // rows, 2, rows, t.shape[1]).transpose(0, 1).contiguous().view(t.shape)


def tileable(w: torch.Tensor, layout: int | None = None) -> bool:
    """Whether ``w`` can be kept in ``layout`` (default: the step's, ``step_layout``) for the C step."""
    shape = tile_shape(w.dtype)
    if shape is None or w.dim() != 2 or w.shape[0] % shape[0] or w.shape[1] % shape[1]:
        return False
    layout = step_layout(w.dtype) if layout is None else layout
    return layout != AMX or (w.shape[0] % AMX_CHANNELS == 0 and w.shape[1] % AMX_INPUTS == 0)


def to_amx(w: torch.Tensor) -> torch.Tensor:
    """A new ``[out, in]`` tensor holding ``w`` as the tile unit's B tiles (decode_step.c's AMX_BLOCK):
    for each block of 16 output channels, its ``in / 32`` tiles in order, each ``[16 input pairs][16
    channels][2]``."""
    out, inp = w.shape
    blocks = w.reshape(out // AMX_CHANNELS, AMX_CHANNELS, inp // AMX_INPUTS, AMX_INPUTS // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous().view(out, inp)


def from_amx(t: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` rows of B tiles ``t`` (``to_amx``; a new tensor)."""
    out, inp = t.shape
    blocks = t.reshape(out // AMX_CHANNELS, inp // AMX_INPUTS, AMX_INPUTS // 2, AMX_CHANNELS, 2)
    return blocks.permute(0, 3, 1, 2, 4).contiguous().view(out, inp)


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
    """A bias-free linear layer over a weight kept in ``head_layout()`` only (decode tiles,
    interleaved where this CPU reads them faster), computed by
    the step's C product (``linear_rows``): every row of the input on its own, so a row's result
    does not depend on the others (oneDNN's bfloat16 GEMM changes a row's result past 32 rows).
    The LM head: at one or a few rows it reads the tiles at the memory bandwidth (bfloat16 on a Zen
    4 EPYC: 1.1-1.5 ms against 1.7-2.1 for oneDNN's packed head); at dozens of rows it is slower
    than oneDNN's GEMM (~1.2-1.5x), which only prompt log-probabilities ask of a head. It replaces
    the packed copy, so the memory is the same. ``weight``: the rows (a copy where interleaved)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("tiles", to_layout(weight.detach(), head_layout()), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return from_layout(self.tiles, head_layout())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_product(self.tiles, x)


def _call(name: str, *args) -> None:
    """The library's product ``name`` on ``args`` and this process's thread count; raises where it declines."""
    rc = getattr(kernels.decode_step_library(), name)(*args, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{name} failed (code {rc})")


def _c_product(weight: torch.Tensor, x: torch.Tensor, name: str, middle: tuple = (), tail: tuple = ()) -> torch.Tensor:
    """``x @ w.T`` in ``weight``'s dtype by the library's ``name`` (``linear_rows``), ``weight`` being ``w``
    ``[out, in]`` in that product's layout: its arguments are the weight, its input and output width, ``middle``,
    the input rows, the output, ``tail`` and the thread count."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).to(weight.dtype).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=weight.dtype)
    _call(name, weight.data_ptr(), in_features, out_features, *middle, rows.data_ptr(), rows.shape[0], out.data_ptr(),
          *tail)
    return out.view(*x.shape[:-1], out_features)


def _amx_rows(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as ``[rows, in]`` in ``dtype`` whose rows the tile GEMM reads where they lie (a row stride of its own,
    as :func:`amx_silu_product`'s output has), copied only where its elements are not consecutive in a row."""
    rows = x.reshape(-1, in_features).to(dtype)
    return rows if rows.stride(1) == 1 and rows.stride(0) >= in_features else rows.contiguous()


def row_stride(width: int, itemsize: int) -> int:
    """Elements between the rows of a ``[rows, width]`` buffer the tile GEMM writes and then reads as A tiles: ``width``,
    or one cache line more where the rows would be a multiple of four lines apart. Sixteen rows of a tile load then
    fall in as many L1 sets instead of four or fewer (1,536 bfloat16 are 48 lines: every fourth row in the same
    set), which cost this model's gate/up and down products ~7% at 745 rows on the AMX Xeon."""
    line = 64 // itemsize
    return width + line if width * itemsize % 256 == 0 else width


def amx_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in bfloat16, where ``weight`` is ``w`` ``[out, in]`` as the tile unit's B tiles (``to_amx``):
    the step's tile product (``linear_amx``), every row of ``x`` on its own. ``x``'s rows are read where they
    lie when its last dimension is dense (a row stride of :func:`row_stride`)."""
    out_features, in_features = weight.shape
    rows = _amx_rows(x, in_features, weight.dtype)
    out = torch.empty(rows.shape[0], out_features, dtype=weight.dtype)
    _call("linear_amx", weight.data_ptr(), in_features, out_features, rows.data_ptr(), rows.stride(0), rows.shape[0],
          out.data_ptr())
    return out.view(*x.shape[:-1], out_features)


def amx_silu_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in bfloat16, gate and up the two halves of ``x @ w.T`` (gate first), ``weight`` being
    ``w`` ``[2 * inter, in]`` as the tile unit's B tiles: ``linear_amx_silu``, each row on its own, the same bits
    as :func:`amx_product` then ``kernels.silu_mul`` in one pass (no ``[rows, 2 * inter]`` product written). The
    result's rows are :func:`row_stride` elements apart (a view), as the down projection reads them best."""
    inter, in_features = weight.shape[0] // 2, weight.shape[1]
    rows = x.reshape(-1, in_features).to(weight.dtype).contiguous()
    stride = row_stride(inter, weight.element_size())
    out = torch.empty(rows.shape[0], stride, dtype=weight.dtype)
    _call("linear_amx_silu", weight.data_ptr(), in_features, inter, rows.data_ptr(), rows.shape[0], out.data_ptr(), stride)
    return out[:, :inter].unflatten(0, x.shape[:-1])


def rows_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in ``weight``'s dtype, where ``weight`` is ``w`` ``[out, in]`` in ``head_layout()``:
    the step's C product (``linear_rows``), every row of ``x`` on its own, as the step's head
    computes them."""
    return _c_product(weight, x, "linear_rows", (int(head_layout() == TILES),), (int(weight.dtype == torch.bfloat16),))


def _agrees(layer: nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``layer`` gives what ``F.linear`` gives on a few rows, up to float32 summation order (one
    step of rounding in bfloat16)."""
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    got, want = layer(x).float(), nn.functional.linear(x, weight).float()
    rounding = 1e-5 if weight.dtype == torch.float32 else 2**-7
    return bool((got - want).abs().max() <= rounding * want.abs().max())


def try_tiled(weight: torch.Tensor) -> TiledLinear | None:
    """A TiledLinear for ``weight`` where this CPU's C product serves it and gives what
    ``F.linear`` gives up to float32 summation order (checked on a few rows), else None."""
    if weight.device.type != "cpu" or not tileable(weight, head_layout()):
        return None
    layer = TiledLinear(weight)
    return layer if _agrees(layer, weight) else None


class AmxLinear(nn.Module):
    """A bias-free linear layer over a bfloat16 weight kept as the tile unit's B tiles only (``to_amx``),
    computed by the fused step's tile product (``linear_amx``): every row on its own, the same bits as the
    step's LM head where the step's projections are on the tile unit (``amx_blocks``). Past 32 rows as a
    GEMM (decode_step.c's ``gemm_amx_blocks``: blocks of 32 rows by 32 channels; the vocabulary head over 100 /
    648 rows 3.5 / 32 ms against 5.1 / 39 for the step's grouping, oneDNN's 3.1 / 32). The LM head there: it replaces
    oneDNN's packed copy, so the memory is the same (the embedding keeps its rows). ``weight``: the rows
    (a copy)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("blocks", to_amx(weight.detach()), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return from_amx(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return amx_product(self.blocks, x)


def try_amx(weight: torch.Tensor) -> AmxLinear | None:
    """An AmxLinear for ``weight`` where the step's projections are on the tile unit here and it gives
    what ``F.linear`` gives up to one bfloat16 rounding (checked on a few rows), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not amx_blocks() \
            or not tileable(weight, AMX):
        return None
    layer = AmxLinear(weight)
    return layer if _agrees(layer, weight) else None
