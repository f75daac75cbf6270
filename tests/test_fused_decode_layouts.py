"""The fused decode step's weight layouts (model/decode_tiles.py, kernels/decode_step.c; docs/ARCHITECTURE.md,
"The fused decode step"): rows and interleaved decode tiles give the same bits; on the AMX tile unit a row's
result is the same alone as in any batch and within the fused tolerance of the vector step; the K/V asked for
ahead of attention changes no result and is asked for only where the weights are interleaved.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model import decode_tiles
from kvmosaic.model.attention import AttentionMetadata, DecodeBatch
from kvmosaic.model.fused_decode import KV_AHEAD_BYTES, FusedDecode, kv_ahead_bytes
from tests.test_fused_decode import FUSED_LOGIT_TOL, _around_fused_steps, _fused_llm, _prompts


def _in_layout(fused: FusedDecode, layout: int) -> FusedDecode:
    """The same step over its dense weights and its head in ``layout`` (the C step reads the head in the
    projections' layout)."""
    def convert(t: torch.Tensor, was: int, paired: bool = False) -> torch.Tensor:
        return decode_tiles.to_layout(decode_tiles.from_layout(t, was, paired), layout, paired)

    weights = [[convert(t, fused.layout, paired=i == 6) if i in (0, 3, 6, 9) else t for i, t in enumerate(layer)]
               for layer in fused.weights]  # w of qkv, o, gate/up (its halves paired in decode tiles), down
    other = FusedDecode(fused.model, weights, fused.dtype, layout=layout)
    other.head = None if fused.head is None else (fused.head[0], convert(fused.head[1], fused.layout))
    return other


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_weight_layouts_give_the_same_steps_bit_for_bit(dtype, monkeypatch):
    """Interleaved decode tiles and rows (decode_tiles.interleave: the CPU's choice for the vector
    step) are the same products in the same order: the step's hidden states and logits are the same bits."""
    llm = _fused_llm(dtype, num_kv_blocks=128)
    compared = []

    def both(fused, x, positions, kv, meta, logits_index):
        rows, tiles = _in_layout(fused, decode_tiles.ROWS), _in_layout(fused, decode_tiles.TILES)
        assert torch.equal(rows(x, positions, kv, meta), tiles(x, positions, kv, meta))
        assert torch.equal(rows.step(x, positions, kv, meta, logits_index),
                           tiles.step(x, positions, kv, meta, logits_index))
        logits = fused.step(x, positions, kv, meta, logits_index)
        compared.append(x.shape[0])
        return logits

    _around_fused_steps(llm.engine.model, monkeypatch, both)
    llm.generate(_prompts(llm.tokenizer), [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)])
    assert compared and max(compared) == 3
    llm.engine.pool.check_invariants()


def test_asking_for_the_kv_ahead_of_attention_changes_no_result(monkeypatch):
    """The QKV projection's K/V prefetch (``kv_ahead``: AMD CPUs only, ``kv_ahead_bytes``) only moves
    lines: the step's hidden states and logits are the same bits with it and without."""
    llm = _fused_llm("bfloat16", num_kv_blocks=128)
    compared = []

    def both(fused, x, positions, kv, meta, logits_index):
        ahead = copy.copy(fused)
        ahead.kv_ahead = KV_AHEAD_BYTES if fused.kv_ahead == 0 else 0
        assert torch.equal(ahead(x, positions, kv, meta), fused(x, positions, kv, meta))
        logits = fused.step(x, positions, kv, meta, logits_index)
        assert torch.equal(ahead.step(x, positions, kv, meta, logits_index), logits)
        compared.append(x.shape[0])
        return logits

    _around_fused_steps(llm.engine.model, monkeypatch, both)
    llm.generate(_prompts(llm.tokenizer), [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)])
    assert compared and max(compared) == 3


@pytest.mark.parametrize("interleaved", [True, False])
def test_the_kv_is_asked_for_ahead_only_where_the_weights_are_interleaved(interleaved, monkeypatch):
    monkeypatch.setattr(decode_tiles, "interleave", lambda: interleaved)
    assert kv_ahead_bytes() == (KV_AHEAD_BYTES if interleaved else 0)


def test_on_the_tile_unit_a_row_alone_equals_the_row_in_any_batch_and_the_vector_steps_within_tolerance(
        monkeypatch):
    """The projections and the head on AMX tiles (``decode_tiles.AMX``): each output from its own row, so a
    row's hidden state and logits are the same bits alone as in a batch of 18 (rows 16-17: the second tile
    of rows) or 36 (past 32: tiles of 32 rows, the last padded); other sums than the vector step's, so its
    logits are within ``FUSED_LOGIT_TOL`` of them."""
    llm = _fused_llm("bfloat16", num_kv_blocks=256)
    if FusedDecode.for_model(llm.engine.model).layout != decode_tiles.AMX:
        pytest.skip("the step's projections are not on the tile unit here (no AMX, or not granted)")
    checked, gaps = [], []

    def check(fused, x, positions, kv, meta, logits_index):
        batched = fused(x, positions, kv, meta)
        logits = fused.step(x, positions, kv, meta, logits_index)
        rows = _in_layout(fused, decode_tiles.ROWS)
        rows.max_rows = None
        gaps.append(float((rows.step(x, positions, kv, meta, logits_index) - logits).abs().max()))
        d = meta.decode
        for row in sorted({0, x.shape[0] // 2, x.shape[0] - 1}):
            n = int(d.lens[row])
            alone = AttentionMetadata(meta.slot_mapping[row : row + 1], decode=DecodeBatch(
                torch.zeros(1, dtype=torch.long), d.ctx_slots[row : row + 1, :n], None, lens=d.lens[row : row + 1]))
            assert torch.equal(fused(x[row : row + 1], positions[row : row + 1], kv, alone)[0], batched[row])
            assert torch.equal(fused.step(x[row : row + 1], positions[row : row + 1], kv, alone, None)[0], logits[row])
        checked.append(x.shape[0])
        return logits

    _around_fused_steps(llm.engine.model, monkeypatch, check)
    for copies in (6, 12):
        prompts = _prompts(llm.tokenizer) * copies
        llm.generate(prompts, [SamplingParams(max_tokens=3 + i % 4, temperature=0, ignore_eos=True)
                               for i in range(len(prompts))])
    assert {18, 36} <= set(checked) and min(checked) <= 16
    assert max(gaps) <= FUSED_LOGIT_TOL["bfloat16"]
    llm.engine.pool.check_invariants()
