"""Issue 21, part 2, in the engine: logits processors (penalties, ``logit_bias``,
``min_tokens``, ``min_p``) against a plain per-row reference, and ``n > 1``: the samples fork
after the prompt, share its KV (computed once), and each gives exactly what a lone request
with its seed gives — on both cache backends and with caching off; nothing stays in use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.engine.logits_processors import apply_logits_processors, apply_min_p
from tests.conftest import make_llm

EOS = 2
PROMPT = "A short note about rivers, lakes and the sea, written for children who like maps. " * 3


# ---- logits processors -------------------------------------------------------------------
def reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    """vLLM's semantics, one token at a time."""
    row = row.clone()
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    if len(out) < p.min_tokens:
        for t in {EOS, *p.stop_token_ids}:
            row[t] = float("-inf")
    return row


def test_processors_match_a_per_token_reference_over_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-1.25),
        SamplingParams(logit_bias={3: 10.0, 7: -100.0}),
        SamplingParams(min_tokens=5, stop_token_ids=[9, 11], max_tokens=8),
        SamplingParams(repetition_penalty=0.5, presence_penalty=-2, frequency_penalty=2, logit_bias={1: 1.5},
                       min_tokens=1),
    ]
    rows = [SimpleNamespace(params=p, prompt_token_ids=torch.randint(0, vocab, (12,), generator=gen).tolist(),
                            output_token_ids=torch.randint(0, vocab, (i,), generator=gen).tolist())
            for i, p in enumerate(params)]
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    got = apply_logits_processors(logits, rows, {EOS})
    for i, r in enumerate(rows):
        want = reference(logits[i], r.params, r.prompt_token_ids, r.output_token_ids)
        assert torch.allclose(got[i], want, atol=1e-5), i
    assert torch.equal(got[0], logits[0])


def test_defaults_leave_the_logits_object_untouched():
    logits = torch.randn(3, 20)
    rows = [SimpleNamespace(params=SamplingParams(), prompt_token_ids=[1, 2], output_token_ids=[3])] * 3
    assert apply_logits_processors(logits, rows, {EOS}) is logits


def test_min_p_keeps_tokens_near_the_top():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(apply_min_p(row, 0.5))
    assert kept.tolist() == [True, True, False, False]
    assert apply_min_p(row, 0.0) is row


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=65), dict(presence_penalty=3), dict(repetition_penalty=0),
                                    dict(min_p=1.5), dict(max_tokens=4, min_tokens=5), dict(logit_bias={1: 500})])
def test_bad_values_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ---- n > 1 -------------------------------------------------------------------------------
def idle(llm) -> None:
    cache = llm.engine.cache
    (cache.check_invariants if hasattr(cache, "check_invariants") else cache.pool.check_invariants)()
    size = cache.size_info()
    assert size.in_use == 0 and not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert size.free + size.evictable + size.in_use == size.total


@pytest.fixture(scope="module", params=["hash", "radix", "none"])
def llm(request):
    return make_llm(prefix_cache=request.param, block_size=16)


def test_samples_compute_the_prompt_once_and_equal_lone_seeded_requests(llm):
    engine = llm.engine
    n_prompt = len(engine.inputs.process(PROMPT).prompt_token_ids)
    assert n_prompt % 16  # the last block is partial: it is copied, not shared
    before = engine.get_stats()
    outs = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11))
    after = engine.get_stats()
    computed = (after.prefix_cache_queries - after.prefix_cache_hits) - \
        (before.prefix_cache_queries - before.prefix_cache_hits)
    assert computed == n_prompt
    assert after.prompt_tokens - before.prompt_tokens == n_prompt
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    idle(llm)
    llm.reset_prefix_cache()
    for j, o in enumerate(outs):  # the copied block and the shared ones hold exactly the prompt's KV
        lone = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + j))[0]
        assert lone.token_ids == o.token_ids, j
    idle(llm)


def test_greedy_samples_equal_one_greedy_request(llm):
    one = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    many = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=0, logprobs=1))
    assert all(o.token_ids == one.token_ids for o in many)
    idle(llm)


def test_aborting_before_the_fork_leaves_nothing(llm):
    engine = llm.engine
    seq = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4))
    children = engine.child_request_ids(seq.request_id, 3)
    assert engine.abort_request(children[0]) is None  # not forked yet: it never will be
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in outs) == [0, 2]
    seq = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4))
    engine.abort_request(seq.request_id)
    assert not engine.has_unfinished_requests() and not engine.step()
    idle(llm)


def test_a_sample_that_finds_no_free_block_queues_and_still_matches():
    llm = make_llm(block_size=16, num_kv_blocks=5)
    n_prompt = len(llm.engine.inputs.process(PROMPT).prompt_token_ids)
    assert -(-n_prompt // 16) == 4  # the parent takes 4 blocks; one is left for one copy
    outs = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5))
    assert [o.index for o in outs] == [0, 1, 2]
    for j, o in enumerate(outs):
        assert llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=5 + j))[0].token_ids == o.token_ids
    idle(llm)


def test_samples_past_max_num_seqs_wait_their_turn():
    llm = make_llm(block_size=16, max_num_seqs=2)
    outs = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=8))
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for j, o in enumerate(outs):
        assert llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=8 + j))[0].token_ids == o.token_ids
    idle(llm)


def test_min_tokens_defers_stop_strings(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    stop = free.text.strip().split()[0]
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0].token_ids) < 12
    held = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=[stop], min_tokens=12))[0]
    assert held.token_ids == free.token_ids
    idle(llm)


def test_a_grammar_mask_allows_exactly_its_tokens():
    """The bitmask unpacking against llguidance's own per-token check (``validate_tokens``)."""
    pytest.importorskip("llguidance")
    from kvmosaic.engine.structured import GrammarFactory, apply_grammars

    llm = make_llm(block_size=16, num_kv_blocks=16)
    vocab = llm.engine.model_config.vocab_size
    m = GrammarFactory(llm.engine.tokenizer, vocab).matcher({"type": "object"})
    out = apply_grammars(torch.zeros(2, vocab), [None, m])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < vocab and torch.isfinite(out[0]).all()
    for t in allowed[:50] + [t for t in range(0, vocab, 997) if t not in allowed][:50]:
        assert (m.validate_tokens([t]) == 1) == (t in allowed), t
