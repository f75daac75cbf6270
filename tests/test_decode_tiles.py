"""The fused decode step's weight layout, float32 and bfloat16 (model/decode_tiles.py): a
permutation that changes no result.

* ``from_tiles(to_tiles(w))`` is ``w``, bit for bit;
* the C product over tiles equals the product over rows bit for bit (same products, same order),
  for a row alone and for a batch;
* a packed projection that switched to the step's layout keeps one copy, still reports its weight
  in rows, and computes its forward as before;
* the layout is the CPU's (interleaved on an AMD EPYC, rows elsewhere) unless
  ``KVMOSAIC_DECODE_LAYOUT`` says, and a wrong value is a clear error.
"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.model import decode_tiles, kernels
from kvmosaic.model.packed_linear import PackedLinear, amx_gemms, packing_supported

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


@pytest.mark.parametrize("layout", [decode_tiles.ROWS, decode_tiles.TILES])
def test_a_gate_up_projections_tiles_are_paired_in_decode_tiles(dtype, layout):
    """``paired`` (the gate/up projection, gate rows then up rows): in decode tiles gate tile t and up tile t
    lie side by side, as the step reads them; in rows the halves stay as they are; either way a permutation
    that ``from_layout`` undoes, and a packed projection still reports its weight in rows."""
    channels = decode_tiles.tile_shape(dtype)[0]
    w = _weight(dtype, 4 * channels, 64)  # two tiles of each half
    kept = decode_tiles.to_layout(w, layout, paired=True)
    assert torch.equal(decode_tiles.from_layout(kept, layout, paired=True), w)
    tile = channels * 64
    if layout == decode_tiles.TILES:
        plain = decode_tiles.to_tiles(w).flatten()  # gate tiles 0, 1, then up tiles 0, 1
        order = [0, 2, 1, 3]
        assert torch.equal(kept.flatten(), torch.cat([plain[i * tile : (i + 1) * tile] for i in order]))
    else:
        assert torch.equal(kept, w)
    assert decode_tiles.pairable(w) and not decode_tiles.pairable(_weight(dtype, 3 * channels, 64))
    if packing_supported(dtype, torch.device("cpu")) and layout == decode_tiles.step_layout(dtype):
        layer = PackedLinear(w.clone())
        assert torch.equal(layer.decode_weight(paired=True), kept) and torch.equal(layer.weight, w)


def test_a_packed_projection_in_the_step_layout_keeps_one_copy_and_its_results(dtype):
    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip("no oneDNN packing in this torch")
    w = _weight(dtype)
    layer = PackedLinear(w.clone())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = layer(x)
    tiles = layer.decode_weight()
    assert layer.decode_weight() is tiles  # converted once
    assert torch.equal(tiles, decode_tiles.to_layout(w, decode_tiles.step_layout(dtype)))
    assert [b.data_ptr() for b in layer.buffers()] == [tiles.data_ptr()]  # the rows were let go
    assert torch.equal(layer.weight, w)
    assert torch.equal(layer(x), before)


def test_the_tiled_head_computes_each_row_alone_and_as_f_linear_does(dtype):
    """The LM head over decode tiles (``TiledLinear``): a row's result is the same bits whatever
    the rows beside it (oneDNN's bfloat16 GEMM changes a row's result past 32 rows), and equals
    ``F.linear`` up to float32 summation order (one rounding step in bfloat16)."""
    w = _weight(dtype, 256, 128)
    head = decode_tiles.try_tiled(w)
    assert head is not None and torch.equal(head.weight, w)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    batch = head(x)
    for i in (0, 17, 39):
        assert torch.equal(head(x[i : i + 1]), batch[i : i + 1])
    want = torch.nn.functional.linear(x, w).float()
    step = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((batch.float() - want).abs() <= step * want.abs().max()).all()


def test_a_packed_model_takes_the_tiled_head(dtype):
    """Except where oneDNN's GEMM runs on AMX tiles: there its packed head is as fast at one row, and where
    the fused step's projections are on the tile unit, its tile product is the head."""
    from kvmosaic.model.config import ModelConfig
    from kvmosaic.model.llama import LlamaForCausalLM

    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip("no oneDNN packing in this torch")
    model = LlamaForCausalLM(ModelConfig(272, 64, 128, 1, 4, 2, 16, 1e4, 1e-5, 512, True))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    model = model.to(dtype)
    model.pack_linears()
    on_tiles = dtype == torch.bfloat16 and decode_tiles.amx_blocks()
    assert type(model.head_proj) is (decode_tiles.AmxLinear if on_tiles and amx_gemms(dtype)
                                     else PackedLinear if amx_gemms(dtype) else decode_tiles.TiledLinear)
    h = torch.randn(3, model.config.hidden_size).to(dtype)
    torch.testing.assert_close(model.compute_logits(h), torch.nn.functional.linear(model.norm(h), model.output_weight).float(),
                               rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.fixture
def fresh_layout():
    """``decode_tiles.interleave`` and ``amx_blocks`` asked anew in the test, and again after it (the
    environment restored)."""
    decode_tiles.interleave.cache_clear(), decode_tiles.amx_blocks.cache_clear()
    yield
    decode_tiles.interleave.cache_clear(), decode_tiles.amx_blocks.cache_clear()


@pytest.mark.parametrize("vendor, interleaved", [("AuthenticAMD", True), ("GenuineIntel", False), ("", False)])
def test_the_layout_is_the_cpus_unless_the_environment_says(vendor, interleaved, monkeypatch, fresh_layout):
    monkeypatch.delenv(decode_tiles.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(decode_tiles, "cpu_vendor", lambda: vendor)
    assert decode_tiles.interleave() is interleaved
    for chosen, want in (("rows", False), ("tiles", True), (" Tiles ", True)):
        decode_tiles.interleave.cache_clear()
        monkeypatch.setenv(decode_tiles.LAYOUT_ENV, chosen)
        assert decode_tiles.interleave() is want
    decode_tiles.interleave.cache_clear()
    monkeypatch.setenv(decode_tiles.LAYOUT_ENV, "columns")
    with pytest.raises(ValueError, match="KVMOSAIC_DECODE_LAYOUT='columns': expected 'tiles', 'rows' or 'amx'"):
        decode_tiles.interleave()


def test_the_tile_units_blocks_are_taken_where_the_library_has_them_unless_the_environment_says(monkeypatch,
                                                                                                fresh_layout):
    """bfloat16 projections on the tile unit where the library says it runs them (built with AMX, the OS
    granting the tile state); ``rows`` or ``tiles`` in the environment turn it off; float32 never."""
    from kvmosaic.model import kernels

    lib = kernels.decode_step_library()
    if lib is None:
        pytest.skip("no kernel library here")
    monkeypatch.delenv(decode_tiles.LAYOUT_ENV, raising=False)
    here = lib.decode_step_amx() == 1
    assert decode_tiles.amx_blocks() is here
    assert (decode_tiles.step_layout(torch.bfloat16) == decode_tiles.AMX) is here
    assert decode_tiles.step_layout(torch.float32) == decode_tiles.head_layout() != decode_tiles.AMX
    for chosen, want in (("rows", False), ("tiles", False), ("amx", here)):
        decode_tiles.interleave.cache_clear(), decode_tiles.amx_blocks.cache_clear()
        monkeypatch.setenv(decode_tiles.LAYOUT_ENV, chosen)
        assert decode_tiles.amx_blocks() is want


def test_the_tile_units_blocks_are_a_permutation_of_the_rows():
    """B tiles of 16 channels x 32 inputs, pairs of inputs side by side (decode_step.c's AMX_BLOCK)."""
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    blocks = decode_tiles.to_amx(w)
    assert torch.equal(decode_tiles.from_amx(blocks), w)
    assert torch.equal(decode_tiles.from_layout(decode_tiles.to_layout(w, decode_tiles.AMX), decode_tiles.AMX), w)
    flat = blocks.flatten()
    # channel block 1, input tile 1, pair 3, channel 5, second of the pair: w[16 + 5, 32 + 2 * 3 + 1]
    assert flat[(1 * 2 + 1) * 512 + (3 * 16 + 5) * 2 + 1] == w[21, 39]
    assert decode_tiles.tileable(w, decode_tiles.AMX) is (decode_tiles.tile_shape(torch.bfloat16) is not None)
    assert not decode_tiles.tileable(w[:24], decode_tiles.AMX)


def test_this_cpus_vendor_is_read():
    with open("/proc/cpuinfo") as f:
        listed = "vendor_id" in f.read()
    assert (decode_tiles.cpu_vendor() != "") == listed


def test_the_tile_units_head_computes_each_row_alone_at_any_batch_and_as_f_linear_does():
    """``AmxLinear`` (the LM head where the step's projections are on the tile unit): a row's result is
    the same bits alone, in one or two tiles of rows, and past 32 rows (gemm_amx_blocks: blocks of 32 rows by 32
    channels, the last rows and an odd block of 16 channels on their own, rows in blocks of 128);
    within one bfloat16 rounding of ``F.linear``."""
    if not decode_tiles.amx_blocks():
        pytest.skip("the step's projections are not on the tile unit here (no AMX, or not granted)")
    w = _weight(torch.bfloat16, 272, 128)  # 17 blocks of 16 channels
    head = decode_tiles.try_amx(w)
    assert head is not None and torch.equal(head.weight, w)
    x = torch.randn(170, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    batch = head(x)
    for rows in (1, 5, 16, 17, 32, 33, 50, 64, 100, 150):
        assert torch.equal(head(x[:rows]), batch[:rows]), f"{rows} rows"
    assert torch.equal(head(x[169:170]), batch[169:170])
    want = torch.nn.functional.linear(x, w).float()
    assert ((batch.float() - want).abs() <= 2**-7 * want.abs().max()).all()
