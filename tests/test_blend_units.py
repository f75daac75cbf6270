"""Segment reuse pieces that need no model: re-rotation, the segment index, token choice."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.blend.rope import rerotate, shift_tables
from kvmosaic.blend.select import attention_weights, choose, deviation, drift_estimate, within_drift
from kvmosaic.cache.hashing import CacheNamespace
from kvmosaic.cache.segments import SegmentIndex, segment_key, segment_seed
from kvmosaic.model.families import Rope
from kvmosaic.model.rotary import RopeAt, RotaryEmbedding, apply_rope

HEAD_DIM, THETA = 64, 100000.0


def test_rerotation_is_exact():
    rope = RotaryEmbedding(HEAD_DIM, THETA, 4096)
    k = torch.randn(40, 3, HEAD_DIM)
    for p, d in [(5, 0), (0, 37), (60, 100), (100, 1500), (2000, -1990), (37, 3000)]:
        pos = torch.arange(p, p + 40)
        at_p = apply_rope(k, *rope(pos, torch.float32))
        at_pd = apply_rope(k, *rope(pos + d, torch.float32))
        moved = rerotate(at_p, d, rope.inv_freq)
        # The model's own float32 tables resolve an angle near position P to P * 2**-24
        # radians, so agreement is bounded by that, not by the rotation.
        atol = 4 * max(p, p + d, 64) * 2**-24 * float(k.abs().max()) * 2
        torch.testing.assert_close(moved, at_pd, atol=atol, rtol=0)


def test_rerotation_per_token_and_layers():
    rope = RotaryEmbedding(HEAD_DIM, THETA, 512)
    k = torch.randn(2, 10, 3, HEAD_DIM)  # [layers, T, heads, dim]
    pos = torch.arange(10)
    moved = rerotate(apply_rope(k, *rope(pos, torch.float32)), torch.full((10,), 7), rope.inv_freq)
    torch.testing.assert_close(moved, apply_rope(k, *rope(pos + 7, torch.float32)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope", [
    Rope(500000.0, "llama3", 8.0, original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0),
    Rope(10000.0, "linear", 4.0), Rope(10000.0, partial=0.5)], ids=["llama3", "linear", "partial"])
def test_rerotation_uses_the_models_own_frequencies(rope):
    """A scaled or partial RoPE moves K exactly as the model would have rotated it there."""
    table = RotaryEmbedding(HEAD_DIM, rope, 4096)
    k = torch.randn(12, 3, HEAD_DIM)
    pos = torch.arange(100, 112)
    at = lambda p: RopeAt.at(table, p).apply_(k.clone())  # noqa: E731 - the model's own rotation
    torch.testing.assert_close(rerotate(at(pos), 900, table.inv_freq), at(pos + 900), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25])  # 0.25: rot 16, the scalar loop
def test_rerotate_store_kernel_equals_rerotate_and_write(dtype, partial):
    """The one-pass placement of a stored segment (``kernels.rerotate_store``) writes the same bits
    as :func:`rerotate` and the pool's write: K moved in float32 and rounded once, V as stored."""
    from kvmosaic.model import kernels
    if not kernels.elementwise_available(torch.zeros(1)):
        pytest.skip("no C kernels here")
    table = RotaryEmbedding(HEAD_DIM, Rope(THETA, partial=partial), 4096)
    g = torch.Generator().manual_seed(0)
    stored = torch.randn(4, 2, 30, 3, HEAD_DIM, generator=g).to(dtype)  # [layers, 2, tokens, heads, dim]
    part = stored[:, :, 7:]  # a segment placed after a prefix hit: its first tokens stay
    slots = torch.randperm(64, generator=g)[: part.shape[2]]
    k_pools, v_pools = ([torch.zeros(64, 3, HEAD_DIM, dtype=dtype) for _ in range(4)] for _ in range(2))
    pools = kernels.pool_rows(k_pools, v_pools)
    for delta in (0, 37, -5, 3000):
        assert kernels.rerotate_store(part, *shift_tables(delta, table.inv_freq), slots, pools)
        moved = rerotate(part[:, 0], delta, table.inv_freq)
        for layer in range(4):
            assert torch.equal(k_pools[layer][slots], moved[layer])
            assert torch.equal(v_pools[layer][slots], part[layer, 1])
    assert not kernels.rerotate_store(part.transpose(3, 4), *shift_tables(1, table.inv_freq), slots, pools)
    assert not kernels.rerotate_store(part, *shift_tables(1, table.inv_freq), slots + 64, pools)  # past the pool


def test_segment_keys_depend_on_tokens_and_namespace_only():
    seed = segment_seed("model-a", "float32")
    ns = CacheNamespace(seed)
    toks = [5, 6, 7]
    assert segment_key(ns, toks) == segment_key(ns, list(toks))
    assert segment_key(CacheNamespace(seed, "s1"), toks) != segment_key(CacheNamespace(seed, "s2"), toks)
    assert segment_key(CacheNamespace(seed, "s1"), toks) != segment_key(ns, toks)
    assert segment_key(CacheNamespace(seed, None, "lora"), toks) != segment_key(ns, toks)
    assert segment_key(CacheNamespace(segment_seed("model-b", "float32")), toks) != segment_key(ns, toks)
    assert segment_key(CacheNamespace(segment_seed("model-a", "bfloat16")), toks) != segment_key(ns, toks)


def test_segment_index_lru_under_budget():
    idx = SegmentIndex(capacity_bytes=100)
    assert idx.insert(b"a", [1], 0, 40) == []
    assert idx.insert(b"b", [2], 0, 40) == []
    assert idx.lookup(b"a", [1]) is not None  # a is now most recent
    assert idx.insert(b"c", [3], 0, 40) == [b"b"]
    assert idx.used_bytes == 80 and set(idx.entries) == {b"a", b"c"}
    assert idx.insert(b"big", [4], 0, 101) is None and idx.used_bytes == 80
    assert idx.lookup(b"a", [9]) is None  # same key, other tokens: a collision is a miss
    assert idx.insert(b"d", [5], 0, 100) == [b"a", b"c"] and idx.used_bytes == 100


def test_choose_ratio_threshold_random():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.05, 0.7])
    assert choose(scores, ratio=0.4).tolist() == [1, 4]
    assert choose(scores, ratio=0.0).numel() == 0
    assert choose(scores, ratio=1.0).tolist() == [0, 1, 2, 3, 4]
    assert choose(scores, threshold=0.3).tolist() == [1, 2, 4]
    r = choose(scores, ratio=0.6, random=True, generator=torch.Generator().manual_seed(0))
    assert r.numel() == 3 and r.unique().numel() == 3


def test_attention_weights_rank_what_the_answer_reads():
    """The ratio ranks deviation x (1 + n * attention); the threshold and the floor read the
    deviation alone, so a token past the floor is never taken however much it is read."""
    scores = torch.tensor([0.10, 0.90, 0.50, 0.004, 0.70])
    attention = torch.tensor([0.60, 0.0, 0.05, 0.30, 0.05])
    weights = attention_weights(attention)
    assert torch.allclose(weights, torch.tensor([4.0, 1.0, 1.25, 2.5, 1.25]))
    assert choose(scores, ratio=0.4).tolist() == [1, 4]  # deviation alone
    assert choose(scores, ratio=0.4, weights=weights).tolist() == [1, 4]  # 0.9 > 0.875 > 0.625 > 0.4
    read = attention_weights(torch.tensor([0.9, 0, 0, 0, 0.1]))  # 5.5, 1, 1, 1, 1.5
    assert choose(scores, ratio=0.2).tolist() == [1]
    assert choose(scores, ratio=0.2, weights=read).tolist() == [4]  # 1.05 > 0.9 > 0.55
    assert choose(scores, threshold=0.6, weights=weights).tolist() == [1, 4]
    floored = choose(scores, ratio=1.0, floor=0.005, weights=attention_weights(torch.tensor([0, 0, 0, 1.0, 0])))
    assert floored.tolist() == [0, 1, 2, 4]


def test_within_drift_takes_the_fewest_highest_scores_left():
    """The guard's repair: beyond what was chosen, the highest scores left, as few as bring the
    estimate of the rest within the bound (the floor does not apply; nothing left: 0). Up to
    DRIFT_SPAN tokens kept the estimate is their mean."""
    scores = torch.tensor([0.1, 0.9, 0.5, 0.004, 0.7])
    chosen = torch.tensor([1])
    assert within_drift(scores, chosen, 0.4).tolist() == []  # left 0.1, 0.5, 0.004, 0.7: mean 0.326
    assert within_drift(scores, chosen, 0.3).tolist() == [4]  # 0.1, 0.5, 0.004: 0.201
    assert within_drift(scores, chosen, 0.2).tolist() == [4, 2]  # 0.1, 0.004: 0.052
    assert within_drift(scores, chosen, 0.0).tolist() == [4, 2, 0, 3]
    assert within_drift(scores, torch.arange(5), 0.0).tolist() == []
    for bound in (0.25, 0.05, 0.003):
        extra = within_drift(scores, chosen, bound)
        left = torch.ones(5, dtype=torch.bool)
        left[torch.cat((chosen, extra))] = False
        assert drift_estimate(scores[left]) <= bound


def test_drift_estimate_grows_with_what_is_kept_past_the_span():
    """The mean over up to ``span`` kept tokens, the sum / ``span`` past it: four times the tokens
    at the same deviation is four times the estimate once past the span, and the repair then
    recomputes until the sum left is within ``bound x span``."""
    assert drift_estimate(torch.tensor([])) == 0.0
    assert drift_estimate(torch.full((4,), 0.02), span=8) == pytest.approx(0.02)
    assert drift_estimate(torch.full((8,), 0.02), span=8) == pytest.approx(0.02)
    assert drift_estimate(torch.full((32,), 0.02), span=8) == pytest.approx(0.08)
    scores = torch.linspace(0.001, 0.04, 32)
    extra = within_drift(scores, torch.empty(0, dtype=torch.long), 0.03, span=8)
    left = torch.ones(32, dtype=torch.bool)
    left[extra] = False
    assert float(scores[left].double().sum()) <= 0.03 * 8 < float(scores[left].double().sum()) + float(scores[extra].min())
    assert extra.tolist() == list(range(31, 31 - extra.numel(), -1))  # the highest first
    assert within_drift(scores, torch.empty(0, dtype=torch.long), 0.03, span=64).numel() < extra.numel()


def test_deviation_is_relative():
    k, v = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    assert torch.allclose(deviation(k, v, k, v), torch.zeros(4))
    d = deviation(k, v, 1.1 * k, 1.1 * v)
    assert torch.allclose(d, torch.full((4,), 0.1), atol=1e-5)


def test_a_segments_left_context_digest_tells_where_it_continues():
    """An entry's ``left`` is the digest of the 16 tokens before it (all of them nearer the
    start): the same tokens give the same digest at any position; one token more, less or
    changed gives another; with a tier secret the digest is keyed."""
    from kvmosaic.blend.store import SegmentKVStore

    store = SegmentKVStore(1 << 20, b"seed")
    prompt = list(range(100, 140))
    at_20 = store.left_digest(prompt, 20)
    assert store.left_digest([7, 8] + prompt, 22) == at_20  # moved by two, same left tokens
    assert store.left_digest(prompt[:19] + [5] + prompt[20:], 20) != at_20
    near_start = store.left_digest(prompt, 3)
    assert store.left_digest(prompt, 3) == near_start
    assert store.left_digest([9] + prompt, 4) != near_start  # four tokens before it, not three
    keyed = SegmentKVStore(1 << 20, b"seed")
    keyed.token_key = b"k" * 32
    assert keyed.left_digest(prompt, 20) != at_20


@pytest.mark.parametrize("field,value,message", [
    ("blend_selection", "loudest", "blend selection must be one of"),
    ("blend_head_tokens", -1, "blend_head_tokens must be non-negative"),
])
def test_blend_options_are_checked_when_the_engine_config_is_made(field, value, message):
    from kvmosaic.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(segment_reuse="auto", **{field: value})
