"""The hybrid KV layout in the engine, on a Gemma-3-like tiny model (5 local : 1 global).

Checked against the classic layout (every layer keeps the whole context; itself checked
against transformers in test_families.py) and transformers: greedy tokens equal and float32
logits within 1e-4, with the cache off, hash, chunked prefill and hits that end inside a
window; the KV a decoding request holds at a context ten windows long is <= 0.30 of the
classic layout's; the pool is idle after.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from kvmosaic import SamplingParams
from tests.conftest import make_llm
from tests.tiny_models import build

WINDOW, BLOCK, NEW = 32, 8, 12
GEMMA3_LIKE = ("Gemma3TextConfig", dict(
    num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-like")
    return str(path), build("gemma3", path, spec=GEMMA3_LIKE)


def prompts() -> list[list[int]]:
    """A prompt ten windows long, then two sharing its first 150 tokens (the hit, 144 tokens,
    ends 16 tokens into a window), one sharing all of it."""
    rng = random.Random(3)
    draw = lambda k: [rng.randrange(256) for _ in range(k)]  # noqa: E731
    first = draw(10 * WINDOW)
    return [first, first[:150] + draw(40), first[:150] + draw(9), list(first)]


def run(path: str, **kw):
    """Outputs, each step's logits per request, bytes held while decoding (per request, at
    its first decode step) and the engine, for the prompts (the first alone, then the rest)."""
    llm = make_llm(model=path, block_size=BLOCK, num_kv_blocks=160, **kw)
    engine, logits, held = llm.engine, {}, {}
    execute = engine.runner.execute

    def wrapped(batch):
        for s, _ in batch:
            seq = s.seq
            if seq.num_computed_tokens == seq.num_prompt_tokens and seq.request_id not in held:
                held[seq.request_id] = engine.kv_bytes_held(seq.request_id)
        result = execute(batch)
        for row, s in enumerate(result.sampling):
            logits.setdefault(s.seq.request_id, []).append(result.logits[row].clone())
        return result

    engine.runner.execute = wrapped
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    ps = prompts()
    outs = llm.generate(ps[:1], params) + llm.generate(ps[1:], params)
    return outs, logits, held, engine


MODES = {"hash": dict(prefix_cache="hash"), "no-cache": dict(prefix_cache="none"),
         "hash-chunked": dict(prefix_cache="hash", max_num_batched_tokens=40)}


@pytest.mark.parametrize("mode", list(MODES))
def test_hybrid_layout_matches_the_classic_one_and_holds_under_a_third(model, mode):
    path, hf = model
    outs, logits, held, engine = run(path, **MODES[mode])
    assert engine.kv_layout.hybrid and len(engine.kv_layout.groups) == 6
    ref_outs, ref_logits, ref_held, ref_engine = run(path, kv_layout="full", **MODES[mode])
    assert not ref_engine.kv_layout.hybrid
    for out, ref in zip(outs, ref_outs):
        assert out.token_ids == ref.token_ids
        diff = max((a - b).abs().max().item() for a, b in zip(logits[out.request_id], ref_logits[ref.request_id]))
        assert diff < 1e-4, f"{mode}: max abs logit difference {diff}"
    cached = [o.num_cached_tokens for o in outs]
    if mode == "no-cache":
        assert cached == [0, 0, 0, 0]
    else:  # the hits are the classic layout's: the window's blocks at the hit point were kept
        assert cached[1:] == [ref.num_cached_tokens for ref in ref_outs[1:]] and min(cached[1:3]) >= 144
    first = outs[0].request_id
    ratio = held[first] / ref_held[ref_outs[0].request_id]
    assert ratio <= 0.30, f"{mode}: KV held {ratio:.3f} of the classic layout's"
    # the pool is idle after: nothing in use, every page free or cached
    assert engine.cache.size_info().in_use == 0
    engine.pool.check_invariants()
    if mode == "hash":  # and the classic layout is itself transformers' (first prompt)
        hf.generation_config.eos_token_id = None
        ids = torch.tensor([prompts()[0]])
        gen = GenerationConfig(max_new_tokens=NEW, do_sample=False)
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        assert outs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_forked_samples_share_and_copy_every_group(model):
    """``n > 1``: the samples fork at the prompt's end (full blocks shared and the partial one
    copied in each group, given-back window blocks not taken) and equal lone seeded requests."""
    path, _ = model
    llm = make_llm(model=path, block_size=BLOCK, num_kv_blocks=160)
    engine, prompt = llm.engine, prompts()[0][:203]  # ends inside a block
    outs = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11))
    st = engine.get_stats()
    assert st.prefix_cache_queries - st.prefix_cache_hits == len(prompt)  # the prompt ran once
    assert engine.cache.size_info().in_use == 0
    llm.reset_prefix_cache()
    for j, o in enumerate(outs):
        lone = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + j))[0]
        assert lone.token_ids == o.token_ids, j
    engine.pool.check_invariants()
    assert engine.cache.size_info().in_use == 0


def test_segment_reuse_set_after_start_stays_off_for_windowed_models(model):
    """EngineConfig refuses segment reuse for a windowed family; a mode set on the running
    engine's config later (as benchmarks switch it between requests) is ignored too: the
    blend pass has no windows, so blending here would attend past them."""
    path, _ = model
    rng = random.Random(5)
    doc = [rng.randrange(256) for _ in range(96)]
    first, moved = [1, 2, 3] + doc + [7, 8], [9, 10, 11, 12] + doc + [13, 14]
    params = SamplingParams(max_tokens=4, temperature=0)
    plain = make_llm(model=path, block_size=BLOCK, num_kv_blocks=160, enable_prefix_caching=False)
    want = [o.token_ids for o in plain.generate([first, moved], params)]
    llm = make_llm(model=path, block_size=BLOCK, num_kv_blocks=160, enable_prefix_caching=False)
    for mode in ("auto", "blend"):
        llm.engine.config.segment_reuse = mode
        assert not llm.engine.segment_reuse.enabled and not llm.engine.segment_reuse.auto_on
        outs = llm.generate([first], params) + llm.generate([moved], params)
        assert [o.token_ids for o in outs] == want
        assert all(not o.auto_reuse for o in outs)
    assert llm.engine.segment_reuse.auto_stats is None
