"""The fused decode step's weight layout, float32 and bfloat16 (model/decode_tiles.py): a
permutation that changes no result.

* ``from_tiles(to_tiles(w))`` is ``w``, bit for bit;
* the C product over tiles equals the product over rows bit for bit (same products, same order),
  for a row alone and for a batch;
* a packed projection that switched to tiles keeps one copy, still reports its weight in rows, and
  computes its forward as before.
"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.model import decode_tiles, kernels
from kvmosaic.model.packed_linear import PackedLinear, packing_supported

DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


@pytest.fixture(params=DTYPES)
def dtype(request) -> torch.dtype:
    if decode_tiles.tile_shape(request.param) is None:
        pytest.skip(f"no fused {request.param} decode step on this CPU (float32 needs AVX-512 or AVX2 with FMA, "
                    "bfloat16 AVX512-BF16)")
    return request.param


def _weight(dtype: torch.dtype, out: int = 128, inp: int = 64) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)).to(dtype)


def test_tiles_are_a_permutation_of_the_rows(dtype):
    w = _weight(dtype)
    t = decode_tiles.to_tiles(w)
    assert t.shape == w.shape and not torch.equal(t, w)
    assert torch.equal(torch.sort(t.flatten()).values, torch.sort(w.flatten()).values)
    assert torch.equal(decode_tiles.from_tiles(t), w)


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_the_product_over_tiles_equals_the_product_over_rows_bit_for_bit(dtype, batch):
    lib = kernels.decode_step_library()
    w = _weight(dtype, 160, 128)
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    outs = []
    for weight, tiled in ((w, 0), (decode_tiles.to_tiles(w), 1)):
        y = torch.empty(batch, 160, dtype=dtype)
        assert lib.linear_rows(weight.data_ptr(), 128, 160, tiled, x.data_ptr(), batch, y.data_ptr(),
                               int(dtype == torch.bfloat16), 2) == 0
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    want = x.double() @ w.double().T  # bfloat16: float32 sums of exact products, rounded once
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[0].double(), want, rtol=tol, atol=tol)


def test_a_packed_projection_in_tiles_keeps_one_copy_and_its_results(dtype):
    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip("no oneDNN packing in this torch")
    w = _weight(dtype)
    layer = PackedLinear(w.clone())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = layer(x)
    tiles = layer.decode_tiles()
    assert layer.decode_tiles() is tiles  # tiled once
    assert [b.data_ptr() for b in layer.buffers()] == [tiles.data_ptr()]  # the rows were let go
    assert torch.equal(layer.weight, w)
    assert torch.equal(layer(x), before)
