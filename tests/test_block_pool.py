"""Invariant 2 (accounting) for the block pool, under any sequence of operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmosaic.cache.block import FreeBlockQueue, KVBlock, NoFreeBlocksError
from kvmosaic.cache.block_pool import BlockPool


class PoolMachine(RuleBasedStateMachine):
    """Requests take, share, index and free blocks in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, block_size=4)
        self.held: list[list[KVBlock]] = []  # each entry: blocks one holder references
        self.next_hash = 0

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free = self.pool.num_free_blocks
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(n)
            assert self.pool.num_free_blocks == free
            return
        blocks = self.pool.get_new_blocks(n)
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
        self.held.append(blocks)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def index_one(self, i):
        blocks = self.held[i % len(self.held)]
        if blocks:
            self.next_hash += 1
            self.pool.cache_block(blocks[-1], b"h%d" % self.next_hash, None, [1, 2, 3, 4])

    @precondition(lambda self: self.pool.cached)
    @rule(i=st.integers(0, 100))
    def hit(self, i):
        hashes = sorted(self.pool.cached)
        block = self.pool.get_cached_block(hashes[i % len(hashes)])
        self.pool.touch([block])
        self.held.append([block])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        blocks = self.held.pop(i % len(self.held))
        self.pool.free_blocks(reversed(blocks))

    @rule()
    def reset(self):
        in_use = self.pool.num_used_blocks
        assert self.pool.reset_prefix_cache() == (in_use == 0)
        if in_use == 0:
            assert not self.pool.cached

    @invariant()
    def accounting_holds(self):
        self.pool.check_invariants()
        refs = {}
        for blocks in self.held:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_free_queue_removes_from_middle_in_constant_steps():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])


def test_evicts_least_recently_freed_and_tail_first():
    pool = BlockPool(4, block_size=2)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    for i, blk in enumerate(a + b):
        pool.cache_block(blk, b"h%d" % i, None, [i, i])
    pool.free_blocks(reversed(a))  # request a ends first, its tail block first
    pool.free_blocks(reversed(b))
    evicted = [blk.block_id for blk in pool.get_new_blocks(4)]
    assert evicted == [a[1].block_id, a[0].block_id, b[1].block_id, b[0].block_id]
    assert pool.num_evictions == 4 and not pool.cached


def test_uncached_free_blocks_are_used_before_evicting():
    pool = BlockPool(3, block_size=2)
    x, y, z = pool.get_new_blocks(3)
    pool.cache_block(x, b"x", None, [0, 0])
    pool.free_blocks([x, y])
    assert pool.get_new_blocks(1)[0] is y  # y held no KV anyone can hit
    assert pool.get_cached_block(b"x") is x


def test_hit_removes_from_free_queue_and_protects():
    pool = BlockPool(2, block_size=2)
    x, y = pool.get_new_blocks(2)
    pool.cache_block(x, b"x", None, [0, 0])
    pool.free_blocks([x, y])
    pool.touch([pool.get_cached_block(b"x")])
    assert pool.num_free_blocks == 1
    pool.get_new_blocks(1)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(b"x") is x  # referenced: never evicted
    pool.check_invariants()


def test_double_free_is_refused():
    pool = BlockPool(1, block_size=2)
    (x,) = pool.get_new_blocks(1)
    pool.free_blocks([x])
    with pytest.raises(RuntimeError):
        pool.free_blocks([x])


def test_token_check_turns_a_collision_into_a_miss():
    pool = BlockPool(1, block_size=2, verify_tokens=True)
    (x,) = pool.get_new_blocks(1)
    pool.cache_block(x, b"h", None, [1, 2])
    assert pool.get_cached_block(b"h", [1, 2]) is x
    assert pool.get_cached_block(b"h", [1, 3]) is None
