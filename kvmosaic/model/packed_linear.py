"""oneDNN pre-packed linear layers for CPU bfloat16 and float32.

``F.linear`` on a plain bfloat16 weight re-lays the weight out for oneDNN on every call; at
decode (one token per sequence) that dominates. Packing once at load time makes decode GEMVs
2-3x faster on AVX-512 machines, with bit-identical results (checked on construction; any
mismatch or a missing op keeps the plain layer).

In float32 ``F.linear`` runs MKL, which on an AMD CPU takes a path without AVX-512: ~200 GFLOP/s
on the 2-core AMD EPYC where oneDNN's packed float32 GEMM runs ~480 (BENCHMARKS.md, issue 26). The
packed layer is float32 throughout but sums in another order than MKL, so it is checked against
``F.linear`` to float32 rounding (``F32_RTOL`` of the output's scale), not for equality.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from . import decode_tiles


class PackedLinear(nn.Module):
    """A bias-free linear layer over a weight packed for oneDNN. Input ``[tokens, in]``.

    Besides oneDNN's copy it keeps the weight itself for the fused decode step, in rows or, once
    :meth:`decode_weight` was called, in that step's layout instead (model/decode_tiles.py):
    one copy either way. ``forward`` reads oneDNN's, or where the step's layout is the tile unit's B tiles
    and the span's row count is within ``tile_rows``, those by the tile GEMM (model/prompt_gemms.py
    sets it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("kept", weight.detach(), persistent=False)  # rows, or the step's layout once _in_step_layout
        self._in_step_layout = False
        self._paired = False  # a gate/up projection's halves paired in the step's layout (decode_tiles.to_step_layout)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.tile_rows: tuple[int, int] | None = None  # spans of (first, last) rows take the tile GEMM
        self.padded_rows = False  # oneDNN's spans past PAD_PAST rows called at padded_row_count's counts

    @property
    def weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight (after :meth:`decode_weight`, rebuilt from the step's layout: a copy
        where it is interleaved)."""
        return decode_tiles.from_step_layout(self.kept, self._paired) if self._in_step_layout else self.kept

    def decode_weight(self, paired: bool = False) -> torch.Tensor:
        """The weight in the fused decode step's layout (``decode_tiles.to_step_layout``, ``paired`` for a
        gate/up projection), kept from now on instead of the rows (``tileable`` must hold, and
        ``pairable`` where ``paired``); a second call returns it as the first made it."""
        if not self._in_step_layout:
            self.kept = decode_tiles.to_step_layout(self.kept, paired)
            self._in_step_layout, self._paired = True, paired
        return self.kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tile_product(x) if self.on_tiles_at(x.shape[0]) else self.onednn_product(x)

    def on_tiles_at(self, rows: int) -> bool:
        """Whether a span of ``rows`` rows takes the tile GEMM (by the rule, or within rows_on_their_own)."""
        span = self.tile_rows
        return span is not None and (span[0] <= rows <= span[1] or _ROWS_ON_THEIR_OWN.get())

    def silu_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate/up projection (the gate's outputs first), ``silu(gate) * up`` of ``x``'s rows in one pass
        of the tile GEMM, at any row count where the projection is on the tile unit (``decode_tiles.
        amx_silu_product``: the bits of :meth:`tile_product` then ``kernels.silu_mul``, faster than oneDNN's
        product then ``silu_mul`` at every count: model/prompt_gemms.py); else None."""
        return decode_tiles.amx_silu_product(self.kept, x) if self.tile_rows is not None else None

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's ``x @ w.T``; with ``padded_rows``, over ``x`` and zero rows up to
        :func:`padded_row_count` (whose outputs are dropped): oneDNN builds its kernel per row count."""
        rows = x.shape[0]
        padded = padded_row_count(rows) if self.padded_rows else rows
        if padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y if padded == rows else y[:rows]

    def tile_product(self, x: torch.Tensor) -> torch.Tensor:
        """The tile GEMM's ``x @ w.T`` (``decode_tiles.AmxLinear``'s product), the weight in the step's
        layout on the tile unit (``decode_weight`` called there): each row on its own."""
        return decode_tiles.amx_product(self.kept, x)


_ROWS_ON_THEIR_OWN = contextvars.ContextVar("rows_on_their_own", default=False)


@contextlib.contextmanager
def rows_on_their_own():
    """Within it, every span of a projection that can take the tile GEMM (``tile_rows`` set) takes it,
    whatever its row count: each row's result is then the same bits at any number of rows, where oneDNN's
    changes with the count on an AMX CPU (``batch_invariant``'s prompt rows: engine/model_runner.py)."""
    token = _ROWS_ON_THEIR_OWN.set(True)
    try:
        yield
    finally:
        _ROWS_ON_THEIR_OWN.reset(token)


PAD_PAST = 256


def padded_row_count(rows: int) -> int:
    """``rows`` past ``PAD_PAST`` rounded up to a step of a sixteenth of its octave, at least 32 rows (768
    for 745, 1,536 for 1,500): a few dozen counts up to the step's token budget, at most ~6% more rows."""
    if rows <= PAD_PAST:
        return rows
    step = max(32, 1 << (rows.bit_length() - 5))
    return -(-rows // step) * step


F32_RTOL = 1e-5  # of the largest output: float32 summation-order noise is ~1e-6 of it


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def amx_gemms(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMMs in ``dtype`` run on AMX tiles here (bfloat16 on a CPU with AMX). There a
    GEMM of a few dozen rows costs what one row does, so the C products that compute row by row (the LM head
    in decode tiles, the fused decode step) pay only at a few rows (measured on a 2-core AMX Xeon:
    BENCHMARKS.md, issue 26, seventh session)."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()


def try_pack(weight: torch.Tensor) -> nn.Module | None:
    """A PackedLinear for ``weight`` if it gives what ``F.linear`` gives (bfloat16: exactly;
    float32: to ``F32_RTOL``), else None."""
    try:
        packed = PackedLinear(weight)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got, want = packed(x), nn.functional.linear(x, weight)
        if weight.dtype == torch.float32:
            if (got - want).abs().max() <= F32_RTOL * want.abs().max():
                return packed
        elif torch.equal(got, want):
            return packed
    except (RuntimeError, AttributeError):
        pass
    return None
