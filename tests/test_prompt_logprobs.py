"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, engine/prompt_logprobs.py): the
log-probability of every prompt token but the first, and the top-k, against transformers on the
same weights; chunked and whole prompts alike; a request asking for them reads nothing from the
cache (nor is counted as a query of it) and leaves its blocks for the next; samples forked from it
carry them."""

from __future__ import annotations

import torch

from kvmosaic import SamplingParams
from tests.conftest import make_llm

PROMPT = [1] + list(range(400, 460))  # 61 tokens: blocks of 16, a partial last one


def _params(k: int = 3, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=k, **kw)


def test_prompt_logprobs_match_transformers(hf_model):
    out = make_llm(block_size=16).generate([{"prompt_token_ids": PROMPT}], _params())[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and out.prompt_ranks[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_ranks) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        entry, row, own = out.prompt_logprobs[i], ref[i - 1], PROMPT[i]
        assert abs(entry[own] - float(row[own])) < 2e-4, i
        top = torch.topk(row, 3)
        assert len(entry) in (3, 4)  # the top 3 and the prompt's token, if it is not among them
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert t in entry or lp - float(top.values[-1]) < 1e-4, i  # a tie at the edge may pick either
        rank = int((row > row[own]).sum()) + 1
        assert abs(out.prompt_ranks[i] - rank) <= int((row - row[own]).abs().lt(1e-4).sum()) - 1, i


def test_chunked_prompt_scores_the_same_and_reads_no_cache():
    whole = make_llm(block_size=16).generate([{"prompt_token_ids": PROMPT}], _params())[0]
    llm = make_llm(block_size=16, max_num_batched_tokens=16)  # four chunks
    engine = llm.engine
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], plain)[0]  # caches the prompt's full blocks
    queries = engine.cache.stats.queries
    scored = llm.generate([{"prompt_token_ids": PROMPT}], _params())[0]
    assert scored.num_cached_tokens == 0 and engine.cache.stats.queries == queries  # no read, no query
    assert scored.token_ids == first.token_ids
    assert scored.prompt_ranks == whole.prompt_ranks
    for a, b in zip(scored.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    again = llm.generate([{"prompt_token_ids": PROMPT}], plain)[0]
    assert again.num_cached_tokens == 48 and again.prompt_logprobs is None  # the cache still serves others
    assert engine.pool.num_used_blocks == 0


def test_a_one_token_prompt_has_one_empty_entry():
    out = make_llm(block_size=16).generate([{"prompt_token_ids": [1]}], _params())[0]
    assert out.prompt_logprobs == [None] and out.prompt_ranks == [None]


def test_forked_samples_carry_the_prompt_logprobs():
    outs = make_llm(block_size=16).generate([{"prompt_token_ids": PROMPT}], _params(1, n=3))
    assert len(outs) == 3 and all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert len(outs[0].prompt_logprobs) == len(PROMPT)


def test_automatic_segment_reuse_leaves_a_scored_prompt_alone():
    llm = make_llm(block_size=16, segment_reuse="auto")
    text = " ".join(f"word{i}" for i in range(120))
    llm.generate([text], SamplingParams(max_tokens=1, temperature=0))  # its chunks are stored
    out = llm.generate(["Intro. " + text], _params(0))[0]
    assert out.auto_reuse is None and out.num_cached_tokens == 0
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt's own token only
