"""The choice of GEMM for a projection's prompt rows (model/prompt_gemms.py): oneDNN's packed product or
the tile unit's, by row-count bucket, measured once per process where the fused step's weights are on the
tile unit; the engine's outputs the same tokens either way."""

from __future__ import annotations

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model import decode_tiles, prompt_gemms
from kvmosaic.model.packed_linear import EDGES, PackedLinear, bucket
from tests.conftest import assert_greedy_within, make_llm, record_logits
from tests.test_batch_composition import BF16_LOGIT_TOL

on_tiles = pytest.mark.skipif(not decode_tiles.amx_blocks(), reason="the step's projections are not on the tile unit here")


def test_buckets_are_half_octaves_from_257_to_2048_rows():
    assert EDGES[0] == 256 and EDGES[-1] == 2048 and list(EDGES) == sorted(set(EDGES))
    assert [bucket(n) for n in (1, 256, 257, 362, 363, 2048, 2049)] == [None, None, 0, 0, 1, len(EDGES) - 2, None]


def test_an_unknown_override_is_refused(monkeypatch):
    monkeypatch.setenv(prompt_gemms.ENV, "fastest")
    with pytest.raises(ValueError, match="onednn"):
        prompt_gemms.choose(torch.nn.Module())


def _projections(llm) -> list[PackedLinear]:
    return [m for m in llm.engine.runner.model.modules() if type(m) is PackedLinear]


@pytest.fixture
def choose_with(monkeypatch):
    """``choose_with(llm, mode)``: the override ``mode`` chosen anew for the model ``llm`` runs; the
    process's measured choice back on every model so chosen afterwards (engines share a model)."""
    models = []

    def choose(llm, mode: str) -> None:
        monkeypatch.setenv(prompt_gemms.ENV, mode)
        models.append(llm.engine.runner.model)
        prompt_gemms.choose(models[-1])

    yield choose
    monkeypatch.delenv(prompt_gemms.ENV)
    for model in models:
        prompt_gemms.choose(model)


@on_tiles
def test_a_span_takes_the_product_its_bucket_chose():
    llm = make_llm(dtype="bfloat16")
    prompt_gemms.choose(llm.engine.runner.model)
    projections = _projections(llm)
    chosen = [p for p in projections if p.tile_buckets is not None]
    assert chosen, "the tile GEMM measured faster in no bucket of any projection shape"
    for p in {(p.out_features, p.in_features): p for p in projections}.values():
        picks = p.tile_buckets or (False,) * (len(EDGES) - 1)
        assert picks == prompt_gemms._picks[(p.out_features, p.in_features, torch.get_num_threads())]
        x = torch.randn(EDGES[-1] + 7, p.in_features).bfloat16()
        for rows in (40, 256, 300, 700, 1500, EDGES[-1] + 7):  # oneDNN's below and past the buckets
            b = bucket(rows)
            want = p.tile_product if b is not None and picks[b] else p.onednn_product
            assert torch.equal(p(x[:rows]), want(x[:rows])), (p.out_features, p.in_features, rows)


@on_tiles
@pytest.mark.parametrize("mode", ["onednn", "tiles"])
def test_the_override_takes_one_product_for_every_bucket(choose_with, mode):
    llm = make_llm(dtype="bfloat16")
    choose_with(llm, mode)
    projections = _projections(llm)
    assert projections and all(p.tile_buckets == ((True,) * (len(EDGES) - 1) if mode == "tiles" else None) for p in projections)


@on_tiles
def test_greedy_outputs_with_either_product_agree(choose_with, tokenizer):
    """A prompt of ~700 tokens (one span in a bucket) and 12 greedy tokens, the span on oneDNN's product
    against the tile GEMM's: the same tokens up to the bfloat16 tolerance (the two sum in another order),
    and no block left behind."""
    prompt = tokenizer.encode("The river carried stones past the old mill while the lamp burned. " * 50,
                              add_special_tokens=False)
    assert bucket(len(prompt)) is not None
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
