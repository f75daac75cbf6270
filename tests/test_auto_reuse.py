"""Automatic segment reuse through the engine (segment_reuse="auto", issue 24; float32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams

HEAD = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "Document: The capital of Zorbia is Quentol, a city of copper roofs and narrow canals where boats carry "
    "fruit, wool and salt to the markets every morning, and the bells of the old tower ring at noon.",
    "Document: Marla keeps seven blue goats on her farm near the Vesk river, milks them at dawn and sells the "
    "cheese at the Saturday market, where her stall is the one with the striped green awning.",
    "Document: The vault under the old library opens with the code 4821, which only the two archivists know, "
    "and it holds maps, letters and a herbal guide older than the library itself.",
]
QUESTION = "What is the vault code?"
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=8)


def text(docs, question=QUESTION, head=HEAD) -> str:
    return head + "\n\n".join(docs) + "\n\nQuestion: " + question + "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, segment_cache_memory=128 << 20, segment_reuse="auto")


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", num_kv_blocks=256)


def run(llm, prompt, salt=None, drift=0.1, cold=True):
    e = llm.engine
    e.config.auto_reuse_max_drift = drift
    if cold:
        assert e.reset_prefix_cache()
    p = {"prompt": prompt, "cache_salt": salt} if salt else prompt
    return llm.generate(p, GREEDY)[0]


def logprobs(out) -> torch.Tensor:
    return torch.tensor([[lp[t] for t in sorted(lp)] for lp in out.logprobs])


def test_reordered_documents_are_found_without_markup(llm, plain):
    llm.engine.segment_reuse.store.clear()
    first = run(llm, text(DOCS))
    assert first.auto_reuse == {"tokens": 0, "drift": None, "fallback": False, "repaired": 0}  # nothing stored yet
    again = run(llm, text(DOCS[::-1]))
    reused = again.auto_reuse["tokens"]
    doc_tokens = sum(len(llm.tokenizer.encode(d, add_special_tokens=False)) for d in DOCS)
    assert reused >= 0.6 * doc_tokens and not again.auto_reuse["fallback"]
    assert 0 < again.auto_reuse["drift"] <= 0.1
    assert again.num_computed_tokens == len(again.prompt_token_ids) - again.num_cached_tokens - reused
    ref = plain.generate(text(DOCS[::-1]), GREEDY)[0]
    assert again.token_ids[:3] == ref.token_ids[:3], (again.text, ref.text)
    st = llm.engine.get_stats()
    assert st.auto_reuse_requests >= 1 and st.auto_reuse_tokens >= reused
    assert llm.engine.get_stats().kv_cache_usage == 0


def test_no_reuse_across_namespaces(llm):
    llm.engine.segment_reuse.store.clear()
    run(llm, text(DOCS), salt="tenant-a")
    other = run(llm, text(DOCS[::-1]), salt="tenant-b")
    assert other.auto_reuse["tokens"] == 0  # tenant b finds nothing tenant a stored
    unsalted = run(llm, text(DOCS[1:] + DOCS[:1]))
    assert unsalted.auto_reuse["tokens"] == 0
    same = run(llm, text(DOCS[::-1]), salt="tenant-a")
    assert same.auto_reuse["tokens"] > 0


def reordered(llm, bound):
    """The same store each time: the documents in order, then reversed under ``bound``."""
    llm.engine.segment_reuse.store.clear()
    run(llm, text(DOCS))
    return run(llm, text(DOCS[::-1]), drift=bound)


def test_guard_repairs_the_most_deviating_tokens_until_the_bound_holds(llm, plain):
    free = reordered(llm, 10.0).auto_reuse
    assert free["repaired"] == 0 and free["drift"] > 0
    stats = llm.engine.get_stats()
    for bound in (free["drift"] * 0.99, free["drift"] * 0.5):
        out = reordered(llm, bound).auto_reuse
        assert not out["fallback"] and out["repaired"] > 0 and 0 < out["tokens"] < free["tokens"]
        assert out["drift"] <= bound
    after = llm.engine.get_stats()
    assert after.auto_reuse_repairs == stats.auto_reuse_repairs + 2
    assert after.auto_reuse_fallbacks == stats.auto_reuse_fallbacks
    assert after.auto_reuse_repaired_tokens > stats.auto_reuse_repaired_tokens
    # Any drift too much: every deviating reused token recomputed, answered as a full prefill.
    out = reordered(llm, 0.0)
    assert out.auto_reuse["drift"] == 0.0 and not out.auto_reuse["fallback"]
    ref = plain.generate(text(DOCS[::-1]), GREEDY)[0]
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(logprobs(out), logprobs(ref), atol=1e-4, rtol=0)


def test_guard_falls_back_to_full_prefill_when_a_blend_ends_above_the_bound(llm, plain, monkeypatch):
    sr = llm.engine.segment_reuse
    options = sr.options
    monkeypatch.setattr(sr, "options", lambda: dataclasses.replace(options(), max_drift=None))  # no repair
    before = llm.engine.get_stats().auto_reuse_fallbacks
    out = reordered(llm, 0.0)
    assert out.auto_reuse["fallback"] and out.auto_reuse["tokens"] == 0 and out.auto_reuse["drift"] > 0
    assert llm.engine.get_stats().auto_reuse_fallbacks == before + 1
    ref = plain.generate(text(DOCS[::-1]), GREEDY)[0]
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(logprobs(out), logprobs(ref), atol=1e-4, rtol=0)


def test_a_request_tightens_the_guard_for_itself_and_may_ask_for_an_exact_prefill(llm, plain):
    """``SamplingParams.extra_args["auto_reuse_max_drift"]`` (vLLM's custom arguments; ``vllm_xargs`` in a
    body): this request's bound, at most the engine's; 0 is an ordinary, exact prefill."""
    def ask(own, engine_bound=10.0):
        llm.engine.segment_reuse.store.clear()
        run(llm, text(DOCS))
        llm.engine.config.auto_reuse_max_drift = engine_bound
        assert llm.engine.reset_prefix_cache()
        return llm.generate(text(DOCS[::-1]), dataclasses.replace(GREEDY, extra_args={"auto_reuse_max_drift": own}))[0]

    free = ask(10.0).auto_reuse
    assert free["repaired"] == 0 and free["drift"] > 0
    tight = ask(free["drift"] * 0.5).auto_reuse  # under the engine's 10: the request's bound holds
    assert tight["repaired"] > 0 and tight["drift"] <= free["drift"] * 0.5
    assert ask(10.0, engine_bound=free["drift"] * 0.5).auto_reuse == tight  # never above the engine's
    lookups = llm.engine.get_stats().auto_reuse_requests
    exact = ask(0)
    assert exact.auto_reuse == {"tokens": 0, "drift": None, "fallback": False, "repaired": 0}
    assert llm.engine.get_stats().auto_reuse_requests == lookups  # not looked up, not blended
    assert plain.engine.reset_prefix_cache()
    ref = plain.generate(text(DOCS[::-1]), GREEDY)[0]
    assert exact.token_ids == ref.token_ids and exact.logprobs == ref.logprobs  # bit-identical
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="auto_reuse_max_drift"):
            SamplingParams(extra_args={"auto_reuse_max_drift": bad})


def test_auto_on_without_hits_equals_off_bit_for_bit(llm, plain):
    """Prompts with nothing to find, and exact prefix hits, are ordinary prefills in auto mode."""
    llm.engine.segment_reuse.store.clear()
    assert llm.engine.reset_prefix_cache() and plain.engine.reset_prefix_cache()  # the same cache states
    prompts = [text(DOCS[:1], "Who keeps goats?"), text(DOCS[1:2], "Where is Quentol?"),
               text(DOCS[:1], "Who keeps goats?")]  # the last: a full prefix hit
    for p in prompts:
        out, ref = run(llm, p, cold=False), plain.generate(p, GREEDY)[0]
        assert out.auto_reuse["tokens"] == 0 and ref.auto_reuse is None
        assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs  # bit-identical


def test_auto_off_reports_nothing_and_stores_nothing(plain):
    store = plain.engine.segment_reuse.store
    out = plain.generate(text(DOCS), GREEDY)[0]
    assert out.auto_reuse is None and len(store.index) == 0
    assert plain.engine.segment_reuse.auto_stats is None


def test_early_edit_reuses_the_rest_at_the_same_position(llm):
    """Cache repair: a changed first line breaks the prefix hit; the chunks after it are reused."""
    llm.engine.segment_reuse.store.clear()
    def head(t):
        return f"<|im_start|>system\nNow: {t}\n\n" + "\n\n".join(DOCS) + "<|im_end|>\n<|im_start|>user\n"
    run(llm, text([], "Who knows the code?", head("2026-11-23 21:40:05")))
    out = run(llm, text([], "Who knows the code?", head("2026-11-24 08:01:17")))
    assert out.num_cached_tokens < 16 and out.auto_reuse["tokens"] > 0.6 * len(out.prompt_token_ids)


def test_early_edit_in_bfloat16_reuses_what_float32_does(llm):
    """In bfloat16 every token behind the edit deviates by the KV's rounding (~0.004, where float32's
    deviate ~3e-4): the floor sits above that (auto_floor), so those tokens stay reused as in float32
    instead of being "repaired" for nothing (measured: 113 of 183 tokens reused at the float32 floor,
    131 with the dtype's)."""
    from kvmosaic.blend.auto import AUTO_FLOOR, auto_floor

    assert auto_floor(torch.float32) == pytest.approx(AUTO_FLOOR, abs=1e-7)
    assert auto_floor(torch.bfloat16) == pytest.approx(AUTO_FLOOR + 2**-8)

    def head(t):
        return f"<|im_start|>system\nNow: {t}\n\n" + "\n\n".join(DOCS) + "<|im_end|>\n<|im_start|>user\n"

    reused = {}
    for name, model in (("float32", llm), ("bfloat16", LLM(dtype="bfloat16", num_kv_blocks=256,
                                                             segment_cache_memory=128 << 20, segment_reuse="auto"))):
        model.engine.segment_reuse.store.clear()
        run(model, text([], "Who knows the code?", head("2026-11-23 21:40:05")))
        reused[name] = run(model, text([], "Who knows the code?", head("2026-11-24 08:01:17"))).auto_reuse["tokens"]
    assert reused["bfloat16"] >= reused["float32"] - 3


def test_marked_segments_keep_working_in_auto_mode(llm):
    llm.engine.segment_reuse.store.clear()
    tail = "Question: " + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
    llm.generate({"prompt": HEAD, "segments": DOCS, "suffix": tail}, GREEDY)
    out = llm.generate({"prompt": HEAD, "segments": DOCS[::-1], "suffix": tail}, GREEDY)[0]
    assert out.num_segment_tokens > 0 and out.auto_reuse is None  # the marked path, as before


def test_chunks_live_in_the_tiers(tmp_path):
    """A second engine on the same disk tier (a restart) finds the chunks the first one stored, even those
    the first stored at its close (deferred past its last step)."""
    tier = [f"disk:{tmp_path}:256MiB"]
    first = LLM(dtype="float32", num_kv_blocks=128, segment_reuse="auto", kv_tiers=tier, auto_reuse_max_drift=0.2)
    first.engine.add_request(text(DOCS), SamplingParams(max_tokens=1))  # done in the step that prefills it
    while first.engine.has_unfinished_requests():
        first.engine.step()
    assert first.engine.segment_reuse.has_pending
    first.engine.close()
    del first
    second = LLM(dtype="float32", num_kv_blocks=128, segment_reuse="auto", kv_tiers=tier, auto_reuse_max_drift=0.2)
    out = second.generate(text(DOCS[::-1]), GREEDY)[0]
    store = second.engine.segment_reuse.store
    assert out.auto_reuse["tokens"] > 0 and store.tier_loads > 0
    # each chunk came back with the digest of what it followed (blend head tokens go by it)
    assert all(e.left is not None and len(e.left) == 16 for e in store.index.entries.values())
    second.engine.close()


def test_a_stored_chunk_keeps_each_tokens_mean_over_its_contexts():
    """``SegmentKVStore.fold``: a running mean per token, its count, a cap past which a context weighs
    ``1 / FOLD_CAP``, and counts gone with the entry (replaced or evicted)."""
    from kvmosaic.blend.store import FOLD_CAP, SegmentKVStore

    store = SegmentKVStore(1 << 20, b"seed")
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 2, 6, 1, 4, generator=g) for _ in range(3))  # [L, K/V, T, heads, head_dim]
    tokens = [5, 6, 7, 8, 9, 10]
    assert store.put(tokens, None, None, 3, a)
    key = store.key(tokens, None, None)
    store.fold([(key, torch.tensor([1, 3]))], b[:, :, [1, 3]])
    mean = store.tensors[key]
    assert torch.allclose(mean[:, :, [1, 3]], (a + b)[:, :, [1, 3]] / 2)
    assert torch.equal(mean[:, :, [0, 2, 4, 5]], a[:, :, [0, 2, 4, 5]])
    assert store.contexts_of(key) == 1  # not every token was computed again
    store.fold([(key, torch.arange(6))], c)
    assert torch.allclose(store.tensors[key][:, :, [1, 3]], (a + b + c)[:, :, [1, 3]] / 3, atol=1e-6)
    assert torch.allclose(store.tensors[key][:, :, 0], (a + c)[:, :, 0] / 2, atol=1e-6)
    assert store.contexts_of(key) == 2 and store.contexts[key].tolist() == [2, 3, 2, 3, 2, 2]
    x = torch.zeros_like(a[:, :, :1])
    for _ in range(FOLD_CAP + 4):
        before = store.tensors[key][:, :, 0].clone()
        store.fold([(key, torch.tensor([0]))], x)
    assert torch.allclose(store.tensors[key][:, :, 0], before * (1 - 1 / FOLD_CAP), atol=1e-6)  # capped weight
    assert store.put(tokens, None, None, 3, a) and store.contexts_of(key) == 1 and torch.equal(store.tensors[key], a)
    small = SegmentKVStore(a.numel() * a.element_size(), b"seed")
    small.put(tokens, None, None, 0, a)
    small.fold([(key, torch.arange(6))], b)
    small.put([1, 2, 3, 4, 5, 6], None, None, 0, a)  # evicts the first
    assert key not in small.tensors and key not in small.contexts
    other = small.key([1, 2, 3, 4, 5, 6], None, None)
    small.fold([(key, torch.arange(6)), (other, torch.tensor([2]))], torch.cat((b, c[:, :, :1]), 2))
    assert torch.allclose(small.tensors[other][:, :, 2], (a[:, :, 2] + c[:, :, 0]) / 2)  # the key evicted: passed over


def test_a_fold_moves_k_to_the_entrys_positions(llm):
    """``Blender.fold`` reads a context's KV from the pool at the span's positions and folds it in with K
    re-rotated to where the entry was computed (V as it is)."""
    from kvmosaic.blend.prompt import SegmentSpan
    from kvmosaic.blend.rope import rerotate
    from kvmosaic.cache.manager import PlainRequest

    e, sr = llm.engine, llm.engine.segment_reuse
    sr.store.clear()
    run(llm, text(DOCS))  # stores the chunks at their positions here
    key, entry = next(iter(sr.store.index.entries.items()))
    stored = sr.store.tensors[key].clone()
    n = len(entry.tokens)
    fake = PlainRequest("fold-probe", list(range(n + 40)))
    table = e.cache.allocate_slots(fake, n + 40, e.cache.match_prefix(fake))
    try:
        slots = e.kv.slots(table, n + 40)
        span = SegmentSpan(40, 40 + n)  # the same tokens 40 positions on, in another context
        g = torch.Generator().manual_seed(1)
        other = torch.randn(stored.shape, generator=g).to(stored)  # the store's dtype and device (the pool's)
        for layer in range(len(e.kv.k)):
            e.kv.write(layer, slots[40:].to(other.device), other[layer, 0], other[layer, 1])
        sr.blender.fold([(span, entry, torch.arange(40, 40 + n))], slots)
    finally:
        e.cache.free(fake)
    k_home = rerotate(other[:, 0], entry.origin - 40, sr.blender.inv_freq)
    assert torch.allclose(sr.store.tensors[key][:, 0], (stored[:, 0] + k_home) / 2, atol=1e-5)
    assert torch.allclose(sr.store.tensors[key][:, 1], (stored[:, 1] + other[:, 1]) / 2, atol=1e-6)
    assert sr.store.contexts_of(key) == 2


def test_a_chunk_waits_for_its_contexts_then_is_reused_as_their_mean(plain):
    """``auto_reuse_contexts=2``: a chunk seen in one context is computed in full again (an ordinary
    prefill, bit for bit auto off's) and folded in; from then on it is reused, and what a blend
    recomputes of it joins its mean too."""
    two = LLM(dtype="float32", num_kv_blocks=256, segment_cache_memory=128 << 20, segment_reuse="auto",
              auto_reuse_contexts=2)
    store = two.engine.segment_reuse.store
    first = run(two, text(DOCS))
    assert first.auto_reuse["tokens"] == 0 and len(store.index) > 0
    assert all(store.contexts_of(k) == 1 for k in store.index.entries)
    second = run(two, text(DOCS[::-1]))
    assert second.auto_reuse["tokens"] == 0  # found, but seen in one context only
    assert plain.engine.reset_prefix_cache()
    ref = plain.generate(text(DOCS[::-1]), GREEDY)[0]
    assert second.token_ids == ref.token_ids and second.logprobs == ref.logprobs  # an ordinary prefill
    doc_chunks = [k for k, entry in store.index.entries.items() if entry.origin > 20]
    assert doc_chunks and all(store.contexts_of(k) == 2 for k in doc_chunks[:3])
    third = run(two, text([DOCS[1], DOCS[2], DOCS[0]]))
    assert third.auto_reuse["tokens"] > 0
    counts = torch.cat([store.contexts[k] for k in doc_chunks if k in store.contexts])
    assert counts.min() >= 2 and counts.max() == 3  # the third context's recomputed tokens joined


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_chunks_are_stored_after_the_step_from_blocks_held_until_then(llm, prefix_cache):
    """A prompt's chunks are stored once the step that completed it is out (``finish_pending``, which the
    next step starts with), from its KV where the step wrote it: the finished request's blocks stay held
    (nothing can take them) until then, and go back to the pool after; with either prefix cache."""
    from kvmosaic.cache.manager import PlainRequest

    if prefix_cache == "radix":
        llm = LLM(dtype="float32", num_kv_blocks=256, segment_cache_memory=128 << 20, segment_reuse="auto",
                  prefix_cache="radix")
    e, sr = llm.engine, llm.engine.segment_reuse
    sr.store.clear()
    assert e.reset_prefix_cache()
    free = e.pool.num_free_blocks  # every block
    e.add_request(text(DOCS), SamplingParams(max_tokens=1, temperature=0), request_id="deferred")
    (out,) = e.step()
    assert out.finished and len(sr.store.index) == 0 and sr.has_pending
    held = -(-len(out.prompt_token_ids) // e.cache.block_size)
    n = (free - held) * e.cache.block_size
    grab = PlainRequest("grab", list(range(n)))
    assert e.cache.allocate_slots(grab, n) is not None  # every block not held (the cache gives up its own) ...
    assert e.cache.allocate_slots(PlainRequest("more", [1]), 1) is None  # ... and no more
    for layer in range(len(e.kv.k)):  # whatever the taker writes leaves the held KV alone
        e.kv.k[layer][e.kv.slots(e.cache.block_table("grab"), n)] = 7.0
    e.finish_pending()
    e.cache.free(grab)
    assert len(sr.store.index) > 0 and not sr.has_pending
    assert all(not (t == 7.0).any() for t in sr.store.tensors.values())
    assert e.reset_prefix_cache() and e.pool.num_free_blocks == free  # the held blocks went back
    again = run(llm, text(DOCS[::-1]))
    assert again.auto_reuse["tokens"] > 0 and not sr.has_pending  # LLM.generate leaves nothing pending
    assert e.reset_prefix_cache() and e.pool.num_free_blocks == free


def test_a_failed_deferred_store_costs_the_chunks_not_the_request_nor_the_blocks(llm, monkeypatch, caplog):
    e, sr = llm.engine, llm.engine.segment_reuse
    sr.store.clear()
    assert e.reset_prefix_cache()
    free = e.pool.num_free_blocks

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(sr.auto, "harvest", broken)
    out = llm.generate(text(DOCS), GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    assert "storing the chunks of a prompt failed" in caplog.text
    assert len(sr.store.index) == 0 and not sr.has_pending and e.pool.num_free_blocks == free


def test_contexts_hold_back_moved_chunks_not_a_repair_at_the_same_position():
    """``auto_reuse_contexts=4``: a document moved to another position waits for its contexts, but the
    chunks behind an early edit (in place: after the same tokens, a few positions off at most) are reused
    at once."""
    four = LLM(dtype="float32", num_kv_blocks=256, segment_cache_memory=128 << 20, segment_reuse="auto",
               auto_reuse_contexts=4)

    def head(t):
        return f"<|im_start|>system\nNow: {t}\n\n" + "\n\n".join(DOCS) + "<|im_end|>\n<|im_start|>user\n"
    run(four, text([], "Who knows the code?", head("2026-11-23 21:40:05")))
    edit = run(four, text([], "Who knows the code?", head("2026-11-24 08:01:17")))
    # all but the chunk right after the edit (a left context it was not computed after)
    assert edit.num_cached_tokens < 16 and edit.auto_reuse["tokens"] > 0.5 * len(edit.prompt_token_ids)
    longer = run(four, text([], "Who knows the code?", head("Tuesday, 24 November 2026, 08:01:17 UTC")))
    shift = len(longer.prompt_token_ids) - len(edit.prompt_token_ids)
    assert 0 < shift <= 16 and longer.auto_reuse["tokens"] >= edit.auto_reuse["tokens"] - 40
    moved = run(four, text(DOCS[::-1]))
    assert moved.auto_reuse["tokens"] == 0  # stored in one context (the system prompt's) only
