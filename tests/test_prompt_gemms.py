"""The GEMM of a projection's prompt rows (model/prompt_gemms.py): oneDNN's packed product or, where the
fused step's weights are on the tile unit, the tile GEMM for spans of ``TILE_ROWS`` rows of the narrow
projections; fixed by the row count, and the engine's outputs the same tokens either way."""

from __future__ import annotations

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model import decode_tiles, prompt_gemms
from kvmosaic.model.packed_linear import PackedLinear
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
    """The narrow projections take the tile GEMM for spans of TILE_ROWS rows and oneDNN's below and past
    them; the wide one (gate/up) oneDNN's always. The same bits as the product called directly."""
    projections = _projections(make_llm(dtype="bfloat16"))
    first, last = prompt_gemms.TILE_ROWS
    for p in {(p.out_features, p.in_features): p for p in projections}.values():
        narrow = p.out_features <= prompt_gemms.TILE_MAX_OUT
        assert p.tile_rows == (prompt_gemms.TILE_ROWS if narrow else None)
        x = torch.randn(last + 7, p.in_features).bfloat16()
        for rows in (40, first - 1, first, 700, last, last + 7):
            want = p.tile_product if narrow and first <= rows <= last else p.onednn_product
            assert torch.equal(p(x[:rows]), want(x[:rows])), (p.out_features, p.in_features, rows)
    assert any(p.tile_rows is not None for p in projections)


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
