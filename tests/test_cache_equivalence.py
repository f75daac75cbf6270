"""Invariant 1: outputs with the cache on equal outputs with it off (float32 logits within
1e-4, greedy tokens identical), including eviction, preemption, chunked prefill, batching."""

from __future__ import annotations

import random

import pytest

from kvmosaic import SamplingParams
from tests.conftest import make_llm, record_logits


def random_workload(tokenizer, seed: int, n: int = 8) -> list[list[int]]:
    """Prompts of irregular lengths that share prefixes of irregular lengths."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta tile grout river stone cloud paper lamp seven orange".split()
    text = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    stems = [tokenizer.encode(text(rng.randint(20, 60)), add_special_tokens=False) for _ in range(3)]
    prompts = []
    for _ in range(n):
        stem = rng.choice(stems)
        cut = rng.randint(len(stem) // 2, len(stem))
        prompts.append(stem[:cut] + tokenizer.encode(" " + text(rng.randint(1, 12)), add_special_tokens=False))
    prompts.append(list(prompts[0]))  # a full hit: identical to an earlier prompt
    return prompts


def run(llm, prompts, max_tokens: int, batched: bool):
    logits = record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if batched:  # two batches: requests admitted in one step cannot hit each other
        half = len(prompts) // 2
        outs = llm.generate(prompts[:half], params) + llm.generate(prompts[half:], params)
    else:
        outs = [llm.generate([p], params)[0] for p in prompts]
    # Request ids are per-engine counters, so both runs name requests alike.
    return outs, [logits[o.request_id] for o in outs]


CASES = {
    "sequential": dict(batched=False),
    "batched": dict(batched=True),
    "chunked-prefill": dict(batched=True, max_num_batched_tokens=24),
    "eviction-and-preemption": dict(batched=True, num_kv_blocks=14, block_size=8),
    "xxhash-small-blocks": dict(batched=False, block_size=4, hash_algo="xxh3_128"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_on_equals_cache_off(case, tokenizer):
    opts = dict(CASES[case])
    batched = opts.pop("batched")
    prompts = random_workload(tokenizer, seed=len(case))
    off_outs, off_logits = run(make_llm(enable_prefix_caching=False, **opts), prompts, 6, batched)
    llm = make_llm(**opts)
    on_outs, on_logits = run(llm, prompts, 6, batched)
    for a, b, la, lb in zip(off_outs, on_outs, off_logits, on_logits):
        assert a.token_ids == b.token_ids
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            assert (x - y).abs().max().item() < 1e-4
    assert all(o.num_cached_tokens == 0 for o in off_outs)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits > 0, "the workload shares prefixes: something must hit"
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    llm.engine.pool.check_invariants()
    if case == "eviction-and-preemption":
        assert stats.num_evictions > 0 and stats.num_preemptions > 0


def test_full_hit_identical_prompt(tokenizer):
    llm = make_llm(block_size=16)
    ids = tokenizer.encode("one two three four five six seven eight " * 6, add_special_tokens=False)
    ids = ids[: 16 * 3]  # exactly three blocks: the last block must be recomputed
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first, second = llm.generate([ids], params)[0], llm.generate([ids], params)[0]
    assert second.num_cached_tokens == 32  # hits stop at n-1 tokens, whole blocks
    assert first.token_ids == second.token_ids
    third = llm.generate([ids + [7]], params)[0]
    assert third.num_cached_tokens == 48


def test_cascade_decode_of_a_shared_prefix_equals_cache_off(tokenizer, monkeypatch):
    """Requests sharing a 6-block prefix decode together through cascade attention (the prefix
    attended once for all of them): outputs equal the cache-off engine's, where nothing is shared."""
    import kvmosaic.engine.model_runner as model_runner
    import kvmosaic.model.attention as attention

    monkeypatch.setattr(model_runner, "cascade_pays", lambda model, kv: True)  # also where the kernel serves
    calls = []
    cascade = attention._merge_shared_prefixes
    monkeypatch.setattr(attention, "_merge_shared_prefixes", lambda *a: calls.append(1) or cascade(*a))
    rng = random.Random(3)
    prefix = [rng.randrange(100, 49000) for _ in range(100)]
    prompts = [prefix + [rng.randrange(100, 49000) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    off_outs, off_logits = run(make_llm(enable_prefix_caching=False), prompts, 8, batched=True)
    assert not calls
    on_outs, on_logits = run(make_llm(), prompts, 8, batched=True)
    assert calls, "shared-prefix decodes must take the cascade path"
    for a, b, la, lb in zip(off_outs, on_outs, off_logits, on_logits):
        assert a.token_ids == b.token_ids
        for x, y in zip(la, lb):
            assert (x - y).abs().max().item() < 1e-4
