"""Segment reuse through the engine (float32, short documents)."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams

HEAD = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "Document: The capital of Zorbia is Quentol, a city of copper roofs and narrow canals. ",
    "Document: Marla keeps seven blue goats on her farm near the Vesk river. ",
    "Document: The vault under the old library opens with the code 4821. ",
]
TAIL = "What is the vault code?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=8)


@pytest.fixture(scope="module")
def llm():
    # no head tokens but where a test asks (the default's are tested there)
    return LLM(dtype="float32", num_kv_blocks=128, segment_cache_memory=64 << 20, blend_head_tokens=0)


def run(llm, docs, mode="off", ratio=0.15, salt=None, cold=True):
    e = llm.engine
    e.config.segment_reuse, e.config.blend_ratio = mode, ratio
    if cold:
        assert e.reset_prefix_cache()
    prompt = {"prompt": HEAD, "segments": docs, "suffix": TAIL}
    if salt:
        prompt["cache_salt"] = salt
    return llm.generate(prompt, GREEDY)[0]


def first_logprobs(out) -> torch.Tensor:
    lp = out.logprobs[0]
    return torch.tensor([lp[t] for t in sorted(lp)])


def assert_same_output(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(first_logprobs(out), first_logprobs(ref), atol=1e-4, rtol=0)


def test_full_ratio_reproduces_full_prefill(llm):
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")  # all new: computed in full, then stored
    order = [DOCS[2], DOCS[0], DOCS[1]]
    ref = run(llm, order)
    out = run(llm, order, mode="blend", ratio=1.0)
    assert out.token_ids == ref.token_ids
    assert sorted(out.logprobs[0]) == sorted(ref.logprobs[0])
    torch.testing.assert_close(first_logprobs(out), first_logprobs(ref), atol=1e-4, rtol=0)
    assert out.num_segment_tokens == 0 and out.num_computed_tokens == len(out.prompt_token_ids)


def test_new_segments_are_an_exact_prefill_and_stored_where_computed(llm):
    store = llm.engine.segment_reuse.store
    store.clear()
    ref = run(llm, DOCS)
    first = run(llm, DOCS, mode="blend")
    assert first.num_segment_tokens == 0 and len(store.index) == len(DOCS)
    assert_same_output(first, ref)
    head_len = len(llm.tokenizer.encode(HEAD))
    origins = [store.get(llm.tokenizer.encode(d), None)[0].origin for d in DOCS]
    assert origins[0] == head_len and origins == sorted(origins)
    n = len(first.prompt_token_ids)
    indexed = run(llm, DOCS, cold=False)  # an exact prefill may serve as a prefix hit
    assert indexed.num_cached_tokens == (n - 1) // 16 * 16
    again = run(llm, DOCS, mode="shift")  # same order: every segment lands where it was computed
    assert again.num_segment_tokens == n - head_len - len(llm.tokenizer.encode(TAIL))
    assert_same_output(again, ref)


def test_reuse_is_reported_and_lossy_below_full_ratio(llm):
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")
    order = [DOCS[1], DOCS[2], DOCS[0]]
    shift = run(llm, order, mode="shift")
    seg_tokens = sum(len(llm.tokenizer.encode(d)) for d in order)
    assert shift.num_segment_tokens == seg_tokens  # shift recomputes no segment token
    n = len(shift.prompt_token_ids)
    assert shift.num_cached_tokens + shift.num_segment_tokens + shift.num_computed_tokens == n
    blend = run(llm, order, mode="blend", ratio=0.5)
    assert 0 < blend.num_segment_tokens < shift.num_segment_tokens


def test_segments_never_cross_salts(llm):
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="shift", salt="tenant-a")
    other = run(llm, DOCS[::-1], mode="shift", salt="tenant-b")
    assert other.num_segment_tokens == 0
    unsalted = run(llm, DOCS[::-1], mode="shift")
    assert unsalted.num_segment_tokens == 0
    same = run(llm, DOCS[::-1], mode="shift", salt="tenant-a")
    assert same.num_segment_tokens > 0


def test_mode_off_is_the_prefix_only_path(llm):
    store = llm.engine.segment_reuse.store
    store.clear()
    out = run(llm, DOCS)
    assert len(store.index) == 0 and out.num_segment_tokens == 0
    ids = out.prompt_token_ids
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]  # the prefix cache is warm now
    assert plain.num_cached_tokens == (len(ids) - 1) // 16 * 16
    assert_same_output(plain, out)


def test_blended_kv_never_serves_as_an_exact_prefix(llm):
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")
    order = [DOCS[1], DOCS[0], DOCS[2]]
    run(llm, order, mode="shift")
    head_len = len(llm.tokenizer.encode(HEAD))
    after = run(llm, order, cold=False)  # mode off, prefix cache as the shift run left it
    assert after.num_cached_tokens <= head_len
    ref = run(llm, order)
    torch.testing.assert_close(first_logprobs(after), first_logprobs(ref), atol=1e-4, rtol=0)


def test_a_separator_marks_segments_in_a_text_prompt(llm):
    e = llm.engine
    sep = "<|doc|>"
    e.inputs.segment_separator = sep  # as LLM(segment_separator=sep) sets it
    try:
        e.segment_reuse.store.clear()
        text = HEAD + sep + sep.join(DOCS) + sep + TAIL
        marked = e.inputs.segmented(text)
        as_dict = e.inputs.segmented({"prompt": HEAD, "segments": DOCS, "suffix": TAIL})
        assert marked == as_dict and sep not in marked.text
        assert e.inputs.segmented(HEAD + TAIL) is None  # no separator: an ordinary prompt
        e.config.segment_reuse = "shift"
        first = llm.generate(text, GREEDY)[0]
        again = llm.generate(HEAD + sep + sep.join(DOCS[::-1]) + sep + TAIL, GREEDY)[0]
        assert first.num_segment_tokens == 0 and again.num_segment_tokens > 0
        assert first.prompt_token_ids == as_dict.token_ids
    finally:
        e.inputs.segment_separator = None


def test_head_tokens_of_every_moved_segment_are_recomputed(llm):
    """``blend_head_tokens``: the first tokens of each reused segment that no longer follows what
    it followed when stored are computed in full (EPIC's LegoLink), the rest reused as before;
    with every token a head token it is a full prefill."""
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")
    order = [DOCS[2], DOCS[1], DOCS[0]]  # each after other tokens than when stored
    seg_tokens = sum(len(llm.tokenizer.encode(d)) for d in order)
    ref = run(llm, order)
    try:
        llm.engine.config.blend_head_tokens = 3
        shift = run(llm, order, mode="shift")
        assert shift.num_segment_tokens == seg_tokens - 3 * len(order)
        llm.engine.config.blend_head_tokens = 1000
        every = run(llm, order, mode="shift")
        assert every.num_segment_tokens == 0
        assert_same_output(every, ref)
    finally:
        llm.engine.config.blend_head_tokens = 0


def test_a_segment_that_still_follows_its_neighbour_keeps_its_head(llm):
    """Stored after DOCS[1], DOCS[2] found after DOCS[1] again (both moved to the front) continues
    the text it was computed in: its first tokens are reused; DOCS[1] and DOCS[0] moved."""
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")
    order = [DOCS[1], DOCS[2], DOCS[0]]
    seg_tokens = sum(len(llm.tokenizer.encode(d)) for d in order)
    try:
        llm.engine.config.blend_head_tokens = 3
        assert run(llm, order, mode="shift").num_segment_tokens == seg_tokens - 3 * 2
    finally:
        llm.engine.config.blend_head_tokens = 0


def test_the_selection_defaults_to_each_modes_better_rule(llm):
    """Automatic reuse ranks by deviation x attention, marked segments by deviation alone (each
    the better on its benchmark); ``blend_selection`` sets either."""
    e = llm.engine
    try:
        e.config.segment_reuse = "auto"
        assert e.segment_reuse.options().selection == "attention"
        e.config.segment_reuse = "blend"
        assert e.segment_reuse.options().selection == "deviation"
        e.config.blend_selection = "random"
        assert e.segment_reuse.options().selection == "random"
    finally:
        e.config.blend_selection, e.config.segment_reuse = None, "off"


def test_placing_by_kernel_or_torch_ops_gives_the_same_blend(llm):
    """The stored KV placed in one pass a segment (``kernels.rerotate_store``) or re-rotated and
    written by torch ops (where the kernel does not serve): the same blended output, bit for bit."""
    if llm.engine.device.type != "cpu":
        pytest.skip("the kernel places segments in CPU pools only")
    blender = llm.engine.segment_reuse.blender
    assert blender.pools is not None, "the kernel serves this CPU pool"
    llm.engine.segment_reuse.store.clear()
    run(llm, DOCS, mode="blend")
    order = [DOCS[1], DOCS[2], DOCS[0]]
    by_kernel = run(llm, order, mode="blend")
    pools, blender.pools = blender.pools, None
    try:
        by_torch = run(llm, order, mode="blend")
    finally:
        blender.pools = pools
    assert by_kernel.num_segment_tokens > 0
    assert by_kernel.token_ids == by_torch.token_ids
    assert torch.equal(first_logprobs(by_kernel), first_logprobs(by_torch))
