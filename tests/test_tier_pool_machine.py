"""Pool accounting and tier accounting together, under any sequence of operations (hypothesis):
a real BlockPool whose observer is the real TierConnector over a small real PagedKVCache and a
real host tier (write-through) plus a second host tier (write-back). After every step the
pool's invariants hold, each tier's byte count equals what it holds and stays in budget, and
every block a tier holds decodes to exactly the KV the pool block had when it was stored."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.kv.block_io import BlockIO
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.kv.tiered import TierConnector
from kvmosaic.tiers import HostTier, TierStack

BS, BLOCKS = 4, 6
SHAPE = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4,
                        kv_bytes_per_token=lambda dtype_bytes: 2 * 2 * 1 * 4 * dtype_bytes)


class PoolWithTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedKVCache(SHAPE, BLOCKS, BS, torch.float32)
        self.io = BlockIO(self.kv, "fp")
        block_bytes = self.io.block_nbytes + 1024  # header and checksum
        self.through = HostTier(3 * block_bytes, name="through", policy="write_through")
        self.back = HostTier(4 * block_bytes, name="back", policy="write_back")
        self.conn = TierConnector(TierStack([self.through, self.back]), self.io)
        self.pool = BlockPool(BLOCKS, BS, observer=self.conn)
        self.held: list = []  # blocks this "request" holds a reference on
        self.written: dict[bytes, torch.Tensor] = {}  # hash -> KV when it was cached
        self.names = itertools.count()

    @rule(n=st.integers(1, 3))
    def allocate_and_fill(self, n):
        if n > self.pool.num_free_blocks:
            return
        for block in self.pool.get_new_blocks(n):
            self.kv.buffer[:, :, block.block_id] = torch.randn(2, 2, BS, 1, 4)
            self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def cache(self, i):
        block = self.held[i % len(self.held)]
        if block.block_hash is None:
            h = next(self.names).to_bytes(8, "little") * 4
            tokens = list(range(BS))
            if self.pool.cache_block(block, h, None, tokens):
                self.written[h] = self.kv.read_block(block.block_id).clone()

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        block = self.held.pop(i % len(self.held))
        self.pool.free_blocks([block])

    @precondition(lambda self: self.pool.cached)
    @rule(i=st.integers(0, 100))
    def hit(self, i):
        block = list(self.pool.cached.values())[i % len(self.pool.cached)]
        self.pool.touch([block])
        self.pool.record_hits([block])
        self.held.append(block)

    @invariant()
    def pool_accounting(self):
        self.pool.check_invariants()

    @invariant()
    def tier_accounting_and_content(self):
        for tier in (self.through, self.back):
            assert tier.used_bytes == sum(len(tier._lru[k]) for k in tier.keys())
            assert tier.used_bytes <= tier.capacity_bytes
            for key in tier.keys():
                got = self.conn.stack.load(key, self.io.meta(key, list(range(BS))))
                assert got is not None, "a stored block failed its own checks"
                kv = torch.frombuffer(bytearray(got.payload), dtype=torch.float32).view(self.io.shape)
                assert torch.equal(kv, self.written[key]), "a tier holds KV the pool never had for that hash"

    def teardown(self) -> None:
        self.conn.close()


PoolWithTiers.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestPoolWithTiers = PoolWithTiers.TestCase
