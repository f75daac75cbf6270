"""TierConnector's record of loaded blocks (kvmosaic/kv/tiered.py, ``_loaded_from``): every entry
goes when its load completes (the block is indexed), is superseded (another copy of the same
block is indexed first) or fails (its request fails before committing). A real BlockPool whose
observer is the real TierConnector over a small PagedKVCache and two write-through host tiers;
the test plays the scheduler's part: ``write_block`` while a step is scheduled, the pool's
``cache_block`` when that step commits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.kv.block_io import BlockIO
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.kv.tiered import TierConnector
from kvmosaic.tiers import HostTier, TierStack, encode_block

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
    pool = BlockPool(BLOCKS, BS)
    pool.observer = conn
    payload = torch.randn(*io.shape).numpy().tobytes()
    for i in (1, 2, 3):  # blocks the source tier holds, as if an earlier run stored them
        source.put(h(i), encode_block(io.meta(h(i), TOKENS), payload))
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
