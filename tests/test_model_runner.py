"""The runner's step inputs (engine/model_runner.py): a step of decodes only is built for the whole
batch at once (``_prepare_decodes``), and gives the very tensors the sequence-by-sequence path
(``_prepare_rows``) gives."""

from __future__ import annotations

import torch

from kvmosaic import SamplingParams
from tests.conftest import make_llm


def _same(fast, rows) -> None:
    ids, pos, meta, logits_index, sampling = fast
    ids2, pos2, meta2, logits_index2, sampling2 = rows
    for a, b in ((ids, ids2), (pos, pos2), (meta.slot_mapping, meta2.slot_mapping), (logits_index, logits_index2),
                 (meta.decode.token_index, meta2.decode.token_index), (meta.decode.ctx_slots, meta2.decode.ctx_slots),
                 (meta.decode.lens, meta2.decode.lens)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert (meta.decode.mask is None) == (meta2.decode.mask is None)
    if meta.decode.mask is not None:
        assert torch.equal(meta.decode.mask, meta2.decode.mask)
    assert meta.prefills == meta2.prefills == [] and meta.decode.shared == meta2.decode.shared == []
    assert [id(s) for s in sampling] == [id(s) for s in sampling2]


def test_a_decode_step_gets_the_same_inputs_built_at_once(monkeypatch):
    llm = make_llm(block_size=16, max_num_batched_tokens=64)  # chunked prompts: 1-token chunks are not decodes
    runner = llm.engine.runner
    prepare = runner._prepare
    seen = {"decodes": 0, "rows": 0}

    def checked(batch, cascade):
        out = prepare(batch, cascade)
        if all(s.num_new_tokens == 1 and s.seq.num_computed_tokens + 1 == s.seq.num_tokens for s, _ in batch):
            _same(runner._prepare_decodes(batch), runner._prepare_rows(batch, False))
            seen["decodes"] += 1
        else:
            seen["rows"] += 1
        return out

    monkeypatch.setattr(runner, "_prepare", checked)
    prompts = [list(range(100, 100 + n)) for n in (5, 16, 17, 40, 130)]  # within a block, at its edge, past it
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 20, 9, 14, 6)])
    assert all(len(o.token_ids) for o in outs)
    assert seen["decodes"] >= 10 and seen["rows"] >= 1  # rows of different lengths decoded together, and prefills


def test_the_warm_up_runs_a_prompt_and_a_decode_and_leaves_no_trace(monkeypatch):
    """At start-up the runner runs a short prompt and one decode (``ModelRunner.warm_up``) over
    blocks nothing holds: no block stays used, no event or token is counted, nothing is cached, and
    the first request's tokens are those of an engine that never warmed up."""
    from kvmosaic.engine.model_runner import ModelRunner, _is_decode

    steps = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, batch: steps.append(
        (batch[0][0].num_new_tokens, _is_decode(batch[0][0]))) or execute(self, batch))
    llm = make_llm(block_size=16, enable_kv_events=True)
    assert steps == [(16, False), (1, True)]
    engine = llm.engine
    assert engine.pool.num_used_blocks == 0 and engine.events.drain() == ([], 0)
    assert engine.prompt_tokens == engine.generation_tokens == 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [0] * 16 + list(range(300, 340))}  # begins as the warm-up's prompt
    first = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0

    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, prompt_tokens=16: None)
    cold = make_llm(block_size=16, enable_kv_events=True)
    assert cold.generate([prompt], params)[0].token_ids == first.token_ids
