"""Scored prompts that share a prefix compute it once (``scored_prefix_cache_memory``,
engine/scored_prefix.py): the scores equal those of an engine that computes every scored prompt
whole, the prefix's hidden rows are found only where a scored prompt computed them, and only in
their own namespace."""

from __future__ import annotations

import pytest
import torch

from kvmosaic import SamplingParams
from tests.conftest import make_llm, packed_gemm_rows_invariant

CONTEXT = list(range(300, 600))
CONTINUATIONS = [list(range(1000 + 7 * i, 1005 + 7 * i)) for i in range(4)]
SCORED = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, logprobs=2)


def _prompts(salt: str | None = None) -> list[dict]:
    return [{"prompt_token_ids": CONTEXT + c, **({"cache_salt": salt} if salt else {})} for c in CONTINUATIONS]


def _assert_same_scores(got, want, tol: float) -> None:
    """Log-probabilities equal to ``tol``; ranks and top tokens equal. Where bfloat16 GEMMs change a row's bits
    with the row count (an AMX Xeon: ``tol`` 0.5, the bfloat16 logit tolerance of test_last_layer_rows.py),
    the top tokens keep their order and a prompt token ranked first stays first except at a near tie (a
    runner-up within 2 * tol); a lower rank among the vocabulary's close log-probabilities is not compared."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids or (tol > 1e-4 and _near_tie(b.logprobs[0], 2 * tol))
        for x, y, rank_x, rank_y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_ranks[1:],
                                        b.prompt_ranks[1:], strict=True):
            assert all(abs(x[t] - y[t]) <= tol for t in x.keys() & y.keys())
            if tol <= 1e-4:
                assert list(x) == list(y) and rank_x == rank_y
            elif not _near_tie(y, 2 * tol):
                assert list(x) == list(y) and (rank_x == 1) == (rank_y == 1)


def _near_tie(logprobs: dict[int, float], margin: float) -> bool:
    values = sorted(logprobs.values(), reverse=True)
    return any(hi - lo <= margin for hi, lo in zip(values, values[1:]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continuations_of_one_context_score_as_if_computed_whole(dtype):
    """One after another and in one batch: every continuation but the first starts after the
    context's cached blocks (their rows kept by the first), and scores as the plain engine's."""
    whole = make_llm(dtype=dtype)
    want = [whole.generate(p, SCORED)[0] for p in _prompts()]
    assert all(o.num_cached_tokens == 0 for o in want)  # without the store a scored prompt reads nothing
    llm = make_llm(dtype=dtype, scored_prefix_cache_memory=16 << 20)
    tol = 0.0 if dtype == "bfloat16" and packed_gemm_rows_invariant() else 1e-4 if dtype == "float32" else 0.5
    one_by_one = [llm.generate(p, SCORED)[0] for p in _prompts()]
    assert [o.num_cached_tokens for o in one_by_one] == [0, 288, 288, 288]
    _assert_same_scores(one_by_one, want, tol)
    batched = llm.generate(_prompts("batch"), [SCORED] * 4)  # another namespace: nothing of the above
    assert [o.num_cached_tokens for o in batched] == [0, 288, 288, 288]  # the others wait for the first's blocks
    _assert_same_scores(batched, want, tol)


def test_rows_come_only_from_scored_prompts_of_the_same_namespace():
    llm = make_llm(scored_prefix_cache_memory=16 << 20)
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(_prompts()[0], plain)  # the context's KV is cached, but no hidden rows were kept
    first = llm.generate(_prompts()[1], SCORED)[0]
    assert first.num_cached_tokens == 0 and len(first.prompt_logprobs) == len(CONTEXT) + 5
    assert llm.generate(_prompts("other")[2], SCORED)[0].num_cached_tokens == 0  # another tenant's salt
    assert llm.generate(_prompts()[3], SCORED)[0].num_cached_tokens == 288
    assert llm.generate(_prompts()[0], plain)[0].num_cached_tokens == 304  # a plain prompt hits the KV as ever


def test_the_store_stays_within_its_bytes_and_forgets_oldest_first():
    block_bytes = 16 * 576 * 4  # float32 rows of one block
    llm = make_llm(scored_prefix_cache_memory=20 * block_bytes)
    store = llm.engine.scheduler.scored
    llm.generate(_prompts()[0], SCORED)
    assert store.bytes == 19 * block_bytes  # the full blocks of the 304 positions scored (of 305)
    other = {"prompt_token_ids": list(range(5000, 5100))}  # 6 more full blocks: the oldest 5 go
    llm.generate(other, SCORED)
    assert store.bytes <= 20 * block_bytes and len(store.rows) == 20
    out = llm.generate(_prompts()[1], SCORED)[0]  # its KV is cached, its first blocks' rows forgotten: computed whole
    assert out.num_cached_tokens == 0
    assert torch.isfinite(torch.tensor([v for e in out.prompt_logprobs[1:] for v in e.values()])).all()


def test_served_lm_eval_requests_share_their_context(tokenizer, hf_model):
    """lm-evaluation-harness's log-likelihood request (token ids, ``echo``, ``logprobs`` 1,
    ``max_tokens`` 1) against a server with the store: the continuations after the first report the
    context as cached and read transformers' log-likelihoods all the same."""
    import httpx

    from kvmosaic.server.launch import ServerProcess

    ctx = tokenizer.encode("Question: which planet is the largest? " * 12 + "Answer:", add_special_tokens=False)
    prompts = [ctx + tokenizer.encode(c, add_special_tokens=False) for c in (" Jupiter", " Mars", " the Moon")]
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "128", "--scored-prefix-cache-memory", "16M") as proc:
        body = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 2 * (len(ctx) // 16) * 16
    for choice, ids in zip(sorted(r.json()["choices"], key=lambda ch: ch["index"]), prompts):
        got = choice["logprobs"]["token_logprobs"][1 : len(ids)]
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-4
