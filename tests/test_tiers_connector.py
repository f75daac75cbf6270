"""The scheduler's KVConnector (kvmosaic/kv/connector.py: its three questions and
``get_finished``), and TierConnector's record of loaded blocks (kvmosaic/kv/tiered.py, ``_loaded_from``): every entry
goes when its load completes (the block is indexed), is superseded (another copy of the same
block is indexed first) or fails (its request fails before committing). A real BlockPool whose
observer is the real TierConnector over a small PagedKVCache and two write-through host tiers;
the test plays the scheduler's part: ``write_block`` while a step is scheduled, the pool's
``cache_block`` when that step commits."""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest
import torch

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.manager import MatchResult
from kvmosaic.kv.block_io import BlockIO
from kvmosaic.kv.connector import KVConnector
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.kv.tiered import TierConnector
from kvmosaic.tiers import HostTier, TierStack

BS, BLOCKS = 4, 8
SHAPE = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4,
                        kv_bytes_per_token=lambda dtype_bytes: 2 * 2 * 1 * 4 * dtype_bytes)
TOKENS = list(range(BS))


def h(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


@pytest.fixture
def rig():
    kv = PagedKVCache(SHAPE, BLOCKS, BS, torch.float32)
    io = BlockIO(kv, "fp")
    source = HostTier(1 << 20, name="source", policy="write_through")
    other = HostTier(1 << 20, name="other", policy="write_through")
    conn = TierConnector(TierStack([source, other]), io)
    pool = BlockPool(BLOCKS, BS, observer=conn)
    payload = torch.randn(*io.shape).numpy().tobytes()
    for i in (1, 2, 3):  # blocks the source tier holds, as if an earlier run stored them
        source.put(h(i), conn.stack.encode(h(i), io.meta(h(i), TOKENS), payload, 0))  # with the host MAC
    yield SimpleNamespace(conn=conn, pool=pool, source=source, other=other, io=io)
    conn.close()


def load(rig, key: bytes):
    """One request's load of ``key`` into a fresh pool block, as the scheduler does it."""
    (payload,) = rig.conn.load_now([key], [0], [TOKENS])
    (block,) = rig.pool.get_new_blocks(1)
    rig.conn.write_block(block.block_id, key, 0, payload)
    return block


def test_two_requests_loading_the_same_block_leave_no_entry(rig):
    a, b = load(rig, h(1)), load(rig, h(1))  # both missed the pool in the same step
    assert rig.conn._loaded_from == {h(1): 0}
    stored = rig.source.stats.stores
    assert rig.pool.cache_block(a, h(1), None, TOKENS)  # the first commit indexes it ...
    assert not rig.pool.cache_block(b, h(1), None, TOKENS)  # ... the second is a duplicate
    assert rig.conn._loaded_from == {}
    assert rig.source.stats.stores == stored  # not written back to the tier it came from
    assert rig.other.contains(h(1))  # the other write-through tier got it
    assert rig.conn.blocks_loaded == 2


def test_loads_whose_requests_failed_before_committing_are_dropped_at_the_next_step(rig):
    a, b = load(rig, h(1)), load(rig, h(1))  # step 1: two requests race to load block 1 ...
    rig.pool.free_blocks([b, a])  # ... and the step fails: freed, never indexed
    assert rig.conn._loaded_from == {h(1): 0}
    (c,) = rig.pool.get_new_blocks(1)  # step 2 computes a block and commits it
    assert rig.pool.cache_block(c, h(9), None, TOKENS)
    d = load(rig, h(2))  # step 3 loads: what step 1 left is gone
    assert rig.conn._loaded_from == {h(2): 0}
    assert rig.pool.cache_block(d, h(2), None, TOKENS)
    assert rig.conn._loaded_from == {}


def test_loads_of_one_step_all_survive_until_its_commit(rig):
    blocks = [load(rig, h(i)) for i in (1, 2, 3)]
    assert set(rig.conn._loaded_from) == {h(1), h(2), h(3)}
    for i, block in zip((1, 2, 3), blocks):
        assert rig.pool.cache_block(block, h(i), None, TOKENS)
    assert rig.conn._loaded_from == {}
    assert rig.source.stats.stores == 3  # the three puts above, none written back


# ---- the scheduler's connector -------------------------------------------------------------------
def seq(rid: str = "r"):
    return SimpleNamespace(request_id=rid, all_token_ids=TOKENS * 5)


def test_host_hits_load_now_and_go_into_the_allocated_blocks(rig):
    kc = KVConnector(rig.conn, BS)
    match = MatchResult(num_tokens=BS, tier_hits=[(h(1), 0), (h(2), 0), (h(7), 0)])  # h(7): held by no tier
    assert kc.get_num_new_matched_tokens(seq(), match) == (2 * BS, False), "the contiguous run that loaded"
    assert rig.conn.load_failures == 1
    blocks = rig.pool.get_new_blocks(3)
    table = [b.block_id for b in blocks]
    kc.update_state_after_alloc(seq(), table, 2 * BS)
    assert rig.conn.blocks_loaded == 2 and set(rig.conn._loaded_from) == {h(1), h(2)}
    assert rig.conn.hit_tokens[0] == 2 * BS
    assert kc._pending == {} and kc._loaded == {}


def test_an_allocation_that_fails_is_asked_again_and_a_finish_drops_all(rig):
    kc = KVConnector(rig.conn, BS)
    match = MatchResult(tier_hits=[(h(1), 0)])
    assert kc.get_num_new_matched_tokens(seq(), match) == (BS, False)
    assert kc.get_num_new_matched_tokens(seq(), MatchResult()) == (0, False)  # the pool has it now
    kc.update_state_after_alloc(seq(), [0], 0)
    assert rig.conn.blocks_loaded == 0
    assert kc.get_num_new_matched_tokens(seq(), match) == (BS, False)
    kc.request_finished(seq(), [])
    assert kc._pending == {}


class SlowTiers:
    """Background loads under the test's control: futures with a deadline, as TierLoader's."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.futs: list[cf.Future] = []
        self.timeout = timeout
        self.written: list = []

    def is_fast(self, tier):
        return False

    def submit(self, keys, tiers, tokens):
        futs = []
        for _ in keys:
            f = cf.Future()
            f.deadline = time.monotonic() + self.timeout
            futs.append(f)
        self.futs += futs
        return futs

    def collect(self, keys, futs):
        out = {}
        for k, f in zip(keys, futs):
            if f.done() and not f.cancelled() and f.result() is not None:
                out[k] = f.result()
        return out

    def write_block(self, block_id, key, tier, payload):
        self.written.append((block_id, key, payload))

    def record_hit(self, tier, n):
        pass


def test_background_loads_park_the_request_until_get_finished_names_it():
    tiers = SlowTiers()
    kc = KVConnector(tiers, BS)
    match = MatchResult(tier_hits=[(h(1), 1), (h(2), 1)])
    assert kc.get_num_new_matched_tokens(seq(), match) == (0, True)
    assert kc.get_finished() == [] and kc.num_loading == 1
    tiers.futs[0].set_result(b"one")
    assert kc.get_finished() == []  # the second is neither done nor late
    tiers.futs[1].set_result(None)  # a failed load: a miss
    assert kc.get_finished(wait=True) == [("r", None)]
    assert kc.get_num_new_matched_tokens(seq(), match) == (BS, False)
    kc.update_state_after_alloc(seq(), [5, 6], BS)
    assert tiers.written == [(5, h(1), b"one")] and kc._loaded == {}


def test_a_late_load_is_a_miss_and_an_abort_cancels():
    tiers = SlowTiers(timeout=0.0)
    kc = KVConnector(tiers, BS)
    assert kc.get_num_new_matched_tokens(seq("late"), MatchResult(tier_hits=[(h(1), 1)])) == (0, True)
    assert kc.get_finished(wait=True) == [("late", None)]
    assert kc.get_num_new_matched_tokens(seq("late"), MatchResult(tier_hits=[(h(1), 1)])) == (0, False)
    tiers.timeout = 5.0
    assert kc.get_num_new_matched_tokens(seq("gone"), MatchResult(tier_hits=[(h(2), 1)])) == (0, True)
    kc.request_finished(seq("gone"), [])
    assert tiers.futs[-1].cancelled() and kc.num_loading == 0 and kc.get_finished() == []


def test_a_load_that_raises_belongs_to_its_request():
    class Broken(SlowTiers):
        def collect(self, keys, futs):
            raise OSError("simulated")

    tiers = Broken(timeout=0.0)
    kc = KVConnector(tiers, BS)
    kc.get_num_new_matched_tokens(seq(), MatchResult(tier_hits=[(h(1), 1)]))
    ((rid, exc),) = kc.get_finished()
    assert rid == "r" and isinstance(exc, OSError) and kc._loaded == {}
