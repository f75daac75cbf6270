"""Eviction policies (lru, lfu, slru, priority) and pinning, in both backends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from radix_sim import FakeKV, FakeReq, admit, make_manager

from kvmosaic.cache.block_pool import BlockPool

BS = 4


def cached_blocks(pool: BlockPool, n: int) -> list:
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]), None, [i] * BS)
    return blocks


def victims(pool: BlockPool, n: int) -> list[int]:
    """Ids of the next ``n`` blocks evicted (the pool has no truly free block left)."""
    out = []
    for b in pool.get_new_blocks(n):
        out.append(b.block_id)
    return out


def test_lru_evicts_least_recently_freed():
    pool = BlockPool(3, BS)
    a, b, c = cached_blocks(pool, 3)
    pool.free_blocks([b, a, c])
    pool.touch([b])
    pool.free_blocks([b])
    assert victims(pool, 3) == [a.block_id, c.block_id, b.block_id]


def test_lfu_evicts_least_used():
    pool = BlockPool(3, BS, eviction_policy="lfu")
    a, b, c = cached_blocks(pool, 3)
    pool.free_blocks([a, b, c])
    for _ in range(3):
        pool.touch([a])
        pool.free_blocks([a])
    pool.touch([c])
    pool.free_blocks([c])
    assert victims(pool, 3) == [b.block_id, c.block_id, a.block_id]


def test_slru_keeps_reused_blocks_over_a_scan_of_one_off_blocks():
    pool = BlockPool(6, BS, eviction_policy="slru")
    hot = cached_blocks(pool, 2)
    pool.free_blocks(hot)
    pool.touch(hot)  # used twice: protected
    pool.free_blocks(hot)
    scan = pool.get_new_blocks(4)  # one-off blocks, freed after the hot ones
    for i, b in enumerate(scan):
        pool.cache_block(b, bytes([10 + i]), None, [i] * BS)
    pool.free_blocks(scan)
    # LRU would evict the hot blocks first (freed earliest); SLRU evicts the scan.
    assert set(victims(pool, 4)) == {b.block_id for b in scan}


def test_slru_protected_segment_is_bounded():
    pool = BlockPool(10, BS, eviction_policy="slru")
    pool.set_eviction_policy("slru")
    pool.evictor.protected_cap = 2
    blocks = cached_blocks(pool, 4)
    pool.free_blocks(blocks)
    pool.touch(blocks)
    pool.free_blocks(blocks)  # all used twice; only 2 fit in the protected segment
    assert len(pool.evictor.protected) == 2 and len(pool.evictor.probation) == 2
    pool.check_invariants()


def test_priority_evicts_low_priority_first():
    pool = BlockPool(3, BS, eviction_policy="priority")
    a, b, c = cached_blocks(pool, 3)
    pool.free_blocks([a], priority=5)
    pool.free_blocks([b], priority=0)
    pool.free_blocks([c], priority=1)
    assert victims(pool, 3) == [b.block_id, c.block_id, a.block_id]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        BlockPool(4, BS, eviction_policy="random")
    with pytest.raises(ValueError):
        make_manager("radix", 4, BS, "mru")


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "slru", "priority"]),
       ops=st.lists(st.tuples(st.sampled_from(["new", "free", "touch", "pin", "unpin", "switch"]),
                              st.integers(0, 1000)), max_size=60))
def test_pool_invariants_under_random_operations(policy, ops):
    pool = BlockPool(8, BS, eviction_policy=policy, max_pinned_blocks=3)
    held: list = []  # one entry per reference a "request" holds
    pinned: list = []
    hashes = 0
    for op, r in ops:
        if op == "new" and pool.num_free_blocks:
            (b,) = pool.get_new_blocks(1)
            hashes += 1
            if r % 2:
                pool.cache_block(b, hashes.to_bytes(4, "big"), None, [r] * BS)
            held.append(b)
        elif op == "free" and held:
            pool.free_blocks([held.pop(r % len(held))], priority=r % 3)
        elif op == "touch" and pool.cached:
            b = list(pool.cached.values())[r % len(pool.cached)]
            pool.touch([b])
            held.append(b)
        elif op == "pin" and pool.cached:
            b = list(pool.cached.values())[r % len(pool.cached)]
            if pool.pin([b]):
                pinned.append(b)
        elif op == "unpin" and pinned:
            pool.unpin([pinned.pop(r % len(pinned))])
        elif op == "switch":
            pool.set_eviction_policy(["lru", "lfu", "slru", "priority"][r % 4])
        pool.check_invariants()
        for b in held + pinned:
            assert b.ref_cnt > 0
    if held:
        assert not pool.reset_prefix_cache()  # refused while a request holds a block
    pool.free_blocks(held)
    pool.unpin(pinned)
    assert pool.num_used_blocks == 0 and pool.reset_prefix_cache()


# ---- pinning through the managers ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_pinned_prefix_survives_eviction_pressure(kind):
    mgr = make_manager(kind, 12, BS, max_pinned_blocks=4)
    kv = FakeKV(BS)
    system = list(range(1, 13))  # 3 blocks
    a = FakeReq("a", system + [99])
    assert admit(mgr, kv, a)
    mgr.free(a)
    pin = mgr.pin_prefix(system)
    assert pin.pin_id is not None and pin.num_tokens == 12
    for i in range(6):  # each needs 4 blocks: would evict the system prompt under any policy
        r = FakeReq(f"x{i}", [100 + i] * 15)
        assert admit(mgr, kv, r)
        mgr.free(r)
    b = FakeReq("b", system + [98])
    assert admit(mgr, kv, b) and b.num_hit == 12
    mgr.free(b)
    mgr.unpin(pin.pin_id)
    assert mgr.size_info().in_use == 0


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_pin_budget_is_bounded(kind):
    mgr = make_manager(kind, 16, BS, max_pinned_blocks=2)
    kv = FakeKV(BS)
    a = FakeReq("a", list(range(20)))
    assert admit(mgr, kv, a)
    mgr.free(a)
    res = mgr.pin_prefix(list(range(20)))  # 5 blocks > 2
    assert res.pin_id is None and res.refused
    ok = mgr.pin_prefix(list(range(8)))
    assert ok.pin_id is not None and ok.num_blocks == 2
    b = FakeReq("b", list(range(50, 58)))
    assert admit(mgr, kv, b)
    mgr.free(b)
    assert mgr.pin_prefix(list(range(50, 58))).refused  # budget used up
    assert mgr.reset_prefix_cache()  # no request runs: the reset drops pins too
    assert mgr.size_info().free == 16


@pytest.mark.parametrize("policy,expect_kept", [("lru", "recent"), ("lfu", "frequent"), ("priority", "important")])
def test_tree_eviction_follows_the_policy(policy, expect_kept):
    mgr = make_manager("radix", 9, BS, policy)
    kv = FakeKV(BS)
    prompts = {"frequent": [1] * 8, "important": [2] * 8, "recent": [3] * 8}
    order = [("frequent", 0), ("frequent", 0), ("frequent", 0), ("important", 9), ("recent", 0)]
    for i, (name, prio) in enumerate(order):
        r = FakeReq(f"{name}{i}", prompts[name] + [i], priority=prio)
        assert admit(mgr, kv, r)
        mgr.free(r)
    big = FakeReq("big", [7] * 20)  # needs 5 blocks; only one of the three prompts survives
    assert admit(mgr, kv, big)
    mgr.free(big)
    ns = mgr.namespace(None, None)
    kept = {n for n, p in prompts.items() if mgr.tree.match(ns, p).num_tokens == 8}
    assert expect_kept in kept
    mgr.check_invariants()
