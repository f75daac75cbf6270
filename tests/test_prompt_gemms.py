"""The GEMM of a projection's prompt rows (model/prompt_gemms.py): oneDNN's packed product or, where the
fused step's weights are on the tile unit, the tile GEMM for every span of the narrow projections and of
gate/up with SiLU . up in its epilogue, and for spans of ``WIDE_TILE_ROWS`` rows of gate/up's plain product;
fixed by the row count, and the engine's outputs the same tokens either way."""

from __future__ import annotations

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model import decode_tiles, prompt_gemms
from kvmosaic.model.packed_linear import PAD_PAST, PackedLinear, padded_row_count, rows_on_their_own
from tests.conftest import assert_greedy_within, make_llm, record_logits
from tests.test_batch_composition import BF16_LOGIT_TOL

on_tiles = pytest.mark.skipif(not decode_tiles.amx_blocks(), reason="the step's projections are not on the tile unit here")


def _projections(llm) -> list[PackedLinear]:
    return [m for m in llm.engine.runner.model.modules() if type(m) is PackedLinear]


@pytest.fixture
def choose_with(monkeypatch):
    """``choose_with(llm, mode)``: the override ``mode`` set anew on the model ``llm`` runs; the rule back
    on every model so set afterwards (a process's engines share a model)."""
    models = []

    def choose(llm, mode: str) -> None:
        monkeypatch.setenv(prompt_gemms.ENV, mode)
        models.append(llm.engine.runner.model)
        prompt_gemms.choose(models[-1])

    yield choose
    monkeypatch.delenv(prompt_gemms.ENV, raising=False)
    for model in models:
        prompt_gemms.choose(model)


def test_an_unknown_override_is_refused(monkeypatch):
    monkeypatch.setenv(prompt_gemms.ENV, "fastest")
    with pytest.raises(ValueError, match="onednn"):
        prompt_gemms.choose(torch.nn.Module())


@on_tiles
def test_a_span_takes_the_product_of_its_row_count():
    """The narrow projections take the tile GEMM for every span, the wide one's plain product (gate/up) for
    WIDE_TILE_ROWS, oneDNN's past them. The same bits as the product called directly."""
    projections = _projections(make_llm(dtype="bfloat16"))
    for p in {(p.out_features, p.in_features): p for p in projections}.values():
        narrow = p.out_features <= prompt_gemms.TILE_MAX_OUT
        first, last = prompt_gemms.TILE_ROWS if narrow else prompt_gemms.WIDE_TILE_ROWS
        assert p.tile_rows == (first, last) and (last > 4096 if narrow else last == 1024)
        x = torch.randn(1500, p.in_features).bfloat16()
        for rows in (1, 40, 256, 257, 700, 1024, 1031, 1500):
            want = p.tile_product if first <= rows <= last else p.onednn_product
            assert torch.equal(p(x[:rows]), want(x[:rows])), (p.out_features, p.in_features, rows)
    assert len({p.tile_rows for p in projections}) == 2


@on_tiles
def test_rows_on_their_own_take_the_tile_gemm_at_any_count():
    """Within ``rows_on_their_own`` (``batch_invariant``'s steps) every span takes the tile GEMM: a row is
    the same bits in a span of 1,500 rows as in one of 20, for every projection kind; outside it, past
    the rule's span of the wide plain product, oneDNN's product again."""
    for p in {(p.out_features, p.in_features): p for p in _projections(make_llm(dtype="bfloat16"))}.values():
        x = torch.randn(1500, p.in_features).bfloat16()
        with rows_on_their_own():
            whole, first = p(x), p(x[:20])
        assert torch.equal(whole, p.tile_product(x)) and torch.equal(whole[:20], first)
        narrow = p.out_features <= prompt_gemms.TILE_MAX_OUT
        assert torch.equal(p(x), p.tile_product(x) if narrow else p.onednn_product(x))


@on_tiles
def test_the_gate_up_silu_product_is_the_tile_gemm_then_silu_mul(monkeypatch):
    """``silu_product``: SiLU·up in the tile GEMM's epilogue (each block finished while the next is summed),
    the same bits as its product then the row kernel's ``silu_mul`` at any row count, past the plain product's
    span too; the layer's MLP takes it at any count."""
    from kvmosaic.model import kernels

    llm = make_llm(dtype="bfloat16")
    layer = llm.engine.runner.model.layers[1]
    p = layer.gate_up_proj
    for rows in (1, 17, 33, 100, 256, 257, 745):
        x = torch.randn(rows, p.in_features).bfloat16()
        assert torch.equal(p.silu_product(x), kernels.silu_mul(p.tile_product(x))), rows
    for rows in (40, 300):
        x = torch.randn(rows, p.in_features).bfloat16()
        want = layer.mlp(x)
        with monkeypatch.context() as m:
            m.setattr(kernels, "silu_mul", lambda _: pytest.fail("the MLP wrote gate/up and ran silu_mul"))
            assert torch.equal(layer.mlp(x), want)


@on_tiles
def test_the_tile_gemm_gives_the_same_bits_shared_by_rows_or_by_channels():
    """Two threads share a product by output channels below ``AMX_ROW_SHARE_GROUPS`` (6) groups of 32 rows a
    thread, by rows from there (decode_step.c): the same bits either way, and as one thread computes them."""
    layer = make_llm(dtype="bfloat16").engine.runner.model.layers[1]
    before = torch.get_num_threads()
    try:
        for p in (layer.qkv_proj, layer.down_proj):
            x = torch.randn(745, p.in_features).bfloat16()
            torch.set_num_threads(2)
            by_rows = p.tile_product(x)  # 24 groups: 12 a thread
            by_channels = torch.cat([p.tile_product(x[i : i + 300]) for i in range(0, 745, 300)])  # 10 or fewer
            silu = layer.gate_up_proj.silu_product(x) if p is layer.qkv_proj else None
            torch.set_num_threads(1)
            assert torch.equal(by_rows, by_channels) and torch.equal(by_rows, p.tile_product(x))
            if silu is not None:
                assert torch.equal(silu, layer.gate_up_proj.silu_product(x))
    finally:
        torch.set_num_threads(before)


@on_tiles
def test_the_down_projection_reads_the_silu_products_rows_where_they_lie():
    """``silu_product``'s rows lie a cache line further apart than their width where the width is a multiple of
    four lines (this model's 1,536 bfloat16: ``decode_tiles.row_stride``), so that a tile load's 16 rows fall in
    16 L1 sets; the down projection reads them in place, the same bits as from a dense copy, at any count (a
    last group of fewer than 32 rows and the step's few-row product too), and oneDNN's product reads them too."""
    layer = make_llm(dtype="bfloat16").engine.runner.model.layers[1]
    gate_up, down = layer.gate_up_proj, layer.down_proj
    assert decode_tiles.row_stride(1536, 2) == 1568 and decode_tiles.row_stride(960, 2) == 960
    for rows in (1, 17, 33, 100, 745):
        act = gate_up.silu_product(torch.randn(rows, gate_up.in_features).bfloat16())
        assert act.shape == (rows, down.in_features)
        assert rows == 1 or act.stride(0) == decode_tiles.row_stride(down.in_features, 2)
        dense = act.contiguous()
        assert torch.equal(down.tile_product(act), down.tile_product(dense)), rows
        assert torch.equal(down.onednn_product(act), down.onednn_product(dense)), rows


def test_onednn_spans_past_256_rows_meet_a_few_dozen_counts():
    """oneDNN builds its kernel per row count: spans past PAD_PAST rows are padded to at most ~6% more
    rows, a few dozen counts up to a step's 8,192 tokens; shorter spans as they are."""
    counts = [padded_row_count(rows) for rows in range(1, 8193)]
    assert counts[:PAD_PAST] == list(range(1, PAD_PAST + 1))
    assert all(rows <= c <= max(rows * 1.07, rows + 31) for rows, c in enumerate(counts, 1))
    assert counts == sorted(counts) and len(set(counts[PAD_PAST:])) <= 100
    assert all(padded_row_count(c) == c for c in counts)


@on_tiles
def test_a_padded_span_is_the_product_at_the_padded_count():
    """With ``padded_rows`` a 745-row span is oneDNN's product over 768 rows, the zero rows' outputs
    dropped: the same bits as that call, and within one bfloat16 rounding of the product at 745 rows."""
    p = next(p for p in _projections(make_llm(dtype="bfloat16")) if p.out_features > prompt_gemms.TILE_MAX_OUT)
    assert p.padded_rows
    x = torch.randn(745, p.in_features).bfloat16()
    got = p(x)
    assert got.shape == (745, p.out_features)
    padded = torch.cat((x, torch.zeros(768 - 745, p.in_features, dtype=x.dtype)))
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(padded, p.packed, None, "none", [], "")[:745])
    exact = torch.ops.mkldnn._linear_pointwise(x, p.packed, None, "none", [], "").float()
    assert ((got.float() - exact).abs() <= 2**-7 * exact.abs() + 1e-6).all()


@on_tiles
@pytest.mark.parametrize(("length", "cached", "batch_invariant"), [(200, 176, False), (700, 592, False),
                                                                  (700, 592, True)])
def test_a_prompt_is_the_same_bits_from_the_cache_or_not(tokenizer, length, cached, batch_invariant):
    """Every projection of a SiLU model's prompt span is on the tile GEMM, which computes each row on its own
    (as the row kernels and the prefill attention do), and so is every span with ``batch_invariant``:
    the new tokens behind cached ones give the logits a cold prefill gives, bit for bit, where oneDNN's
    GEMM changes a row with the row count (up to 32 rows and past them it runs other kernels)."""
    assert prompt_gemms.WIDE_TILE_ROWS[0] == prompt_gemms.TILE_ROWS[0] == 1
    prompt = tokenizer.encode("A lamp burned by the mill; the river ran on past the stones. " * 100,
                              add_special_tokens=False)[:length]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    firsts = []
    for caching in (True, False):
        llm = make_llm(dtype="bfloat16", enable_prefix_caching=caching, batch_invariant=batch_invariant)
        llm.generate([prompt[:cached]], params)
        logits = record_logits(llm)
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == (cached if caching else 0)
        firsts.append(logits[out.request_id][0])
    assert torch.equal(firsts[0], firsts[1])


@on_tiles
@pytest.mark.parametrize("mode", ["onednn", "tiles"])
def test_the_override_takes_one_product_for_every_span(choose_with, mode):
    llm = make_llm(dtype="bfloat16")
    choose_with(llm, mode)
    projections = _projections(llm)
    assert projections and all(p.tile_rows == (prompt_gemms.ALL_ROWS if mode == "tiles" else None)
                               for p in projections)


@on_tiles
def test_greedy_outputs_with_either_product_agree(choose_with, tokenizer):
    """A prompt of ~700 tokens (one span the rule gives the tile GEMM) and 12 greedy tokens, every span on
    oneDNN's product against every span on the tile GEMM's: the same tokens up to the bfloat16 tolerance
    (the two sum in another order), and no block left behind."""
    prompt = tokenizer.encode("The river carried stones past the old mill while the lamp burned. " * 50,
                              add_special_tokens=False)
    assert prompt_gemms.TILE_ROWS[0] <= len(prompt) <= prompt_gemms.TILE_ROWS[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for mode in ("onednn", "tiles"):
        llm = make_llm(dtype="bfloat16")
        choose_with(llm, mode)
        logits = record_logits(llm)
        out = llm.generate([prompt], params)[0]
        runs.append(([out.token_ids], [logits[out.request_id]]))
        llm.engine.pool.check_invariants()
    (a_tokens, a_logits), (b_tokens, b_logits) = runs
    assert_greedy_within(BF16_LOGIT_TOL, a_tokens, b_tokens, a_logits, b_logits)
