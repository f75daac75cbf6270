"""The sampler's greedy pass (engine/sampler.py): ``row_maxima`` gives what ``torch.max(logits, -1)``
gives, ties, NaN and infinities included, so greedy tokens and the rows sent down the careful path
are the same as with torch's reduction."""

from __future__ import annotations

import math

import torch

from kvmosaic.engine.sampler import row_maxima


def test_row_maxima_equals_torch_max_on_every_kind_of_row():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 49152, generator=g)
    rows[1, [7, 9000, 40000]] = 50.0  # a tie: the first index
    rows[2, 300] = float("nan")  # NaN wins, wherever it is
    rows[3, [11, 12]] = float("inf")
    rows[4] = float("-inf")
    rows[5, :10] = float("nan")
    rows[6, 5] = float("-inf")
    rows[7] = 0.0  # all equal: index 0
    rows[8, -1] = 1e30  # the last one
    best, index = row_maxima(rows)
    want_best, want_index = (t.tolist() for t in rows.max(-1))
    assert index == want_index
    assert [math.isnan(x) for x in best] == [math.isnan(x) for x in want_best]
    assert [x for x in best if not math.isnan(x)] == [x for x in want_best if not math.isnan(x)]
    strided = rows[:, ::2]  # a view, as a logits processor may leave
    assert row_maxima(strided)[1] == strided.max(-1).indices.tolist()


def test_allowed_token_ids_leave_only_those_tokens_possible():
    from types import SimpleNamespace

    from kvmosaic.engine.logits_processors import apply_logits_processors
    from kvmosaic.engine.sampling_params import SamplingParams

    logits = torch.randn(3, 50)
    rows = [SimpleNamespace(params=SamplingParams(allowed_token_ids=[3, 7, 49, 70]), prompt_token_ids=[1],
                            output_token_ids=[]),
            SimpleNamespace(params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[]),
            SimpleNamespace(params=SamplingParams(allowed_token_ids=[0], logit_bias={0: 2.0}), prompt_token_ids=[1],
                            output_token_ids=[])]
    out = apply_logits_processors(logits, rows, eos_ids=[2])
    kept = torch.isfinite(out[0]).nonzero().squeeze(1).tolist()
    assert kept == [3, 7, 49] and torch.equal(out[0, kept], logits[0, kept])  # 70 is past the vocabulary
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).sum() == 1 and out[2, 0] == logits[2, 0] + 2.0
