"""The fused decode step's float32 weight layout (model/decode_tiles.py): a permutation that
changes no result.

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

pytestmark = pytest.mark.skipif(decode_tiles.tile_shape() is None,
                                reason="no fused float32 decode step on this CPU (needs AVX-512 or AVX2 with FMA)")


def _weight(out: int = 96, inp: int = 64) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp))


def test_tiles_are_a_permutation_of_the_rows():
    w = _weight()
    t = decode_tiles.to_tiles(w)
    assert t.shape == w.shape and not torch.equal(t, w)
    assert torch.equal(torch.sort(t.flatten()).values, torch.sort(w.flatten()).values)
    assert torch.equal(decode_tiles.from_tiles(t), w)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_product_over_tiles_equals_the_product_over_rows_bit_for_bit(batch):
    lib = kernels.decode_step_library()
    w = _weight(160, 96)
    x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(1))
    outs = []
    for weight, tiled in ((w, 0), (decode_tiles.to_tiles(w), 1)):
        y = torch.empty(batch, 160)
        assert lib.linear_rows(weight.data_ptr(), 96, 160, tiled, x.data_ptr(), batch, y.data_ptr(), 0, 2) == 0
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")), reason="no oneDNN packing in this torch")
def test_a_packed_projection_in_tiles_keeps_one_copy_and_its_results():
    w = _weight()
    layer = PackedLinear(w.clone())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    before = layer(x)
    tiles = layer.decode_tiles()
    assert layer.decode_tiles() is tiles  # tiled once
    assert [b.data_ptr() for b in layer.buffers()] == [tiles.data_ptr()]  # the rows were let go
    assert torch.equal(layer.weight, w)
    assert torch.equal(layer(x), before)
