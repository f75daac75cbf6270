"""A model-free driver for cache managers: fake requests whose "KV" is the token history.

Each block slot stores the tuple of tokens up to and including its position, which is what
real KV depends on; a manager that hands out a block for a prefix it does not hold, or a
copy-on-write that copies the wrong slots, shows up as a wrong history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.manager import KVCacheManager, PlainRequest
from kvmosaic.cache.radix import RadixCacheManager

SEED = b"\x00" * 32


@dataclass
class FakeReq(PlainRequest):
    num_computed: int = 0
    num_hit: int = 0


@dataclass
class FakeKV:
    """Per block id, per slot: (namespace, history) of the token whose KV is there."""

    block_size: int
    slots: dict[int, list] = field(default_factory=dict)

    def write(self, table: list[int], req: FakeReq, start: int, end: int) -> None:
        bs = self.block_size
        ns = (req.cache_salt, req.adapter_id)
        for p in range(start, end):
            self.slots.setdefault(table[p // bs], [None] * bs)[p % bs] = (ns, tuple(req.all_token_ids[: p + 1]))

    def copy(self, src: int, dst: int, n: int) -> None:
        s = self.slots.get(src, [None] * self.block_size)
        d = self.slots.setdefault(dst, [None] * self.block_size)
        d[:n] = s[:n]

    def check(self, table: list[int], req: FakeReq, end: int) -> None:
        bs = self.block_size
        ns = (req.cache_salt, req.adapter_id)
        for p in range(end):
            got = self.slots.get(table[p // bs], [None] * bs)[p % bs]
            assert got == (ns, tuple(req.all_token_ids[: p + 1])), f"wrong KV at position {p}"


def make_manager(kind: str, num_blocks: int, block_size: int, policy: str = "lru", **kw) -> KVCacheManager:
    pool = BlockPool(num_blocks, block_size, eviction_policy=policy, **kw)
    if kind == "radix":
        return RadixCacheManager(pool, SEED, eviction_policy=policy)
    return HashCacheManager(pool, SEED, lambda o: __import__("hashlib").sha256(repr(o).encode()).digest(),
                            enable_caching=kind == "hash")


def admit(mgr: KVCacheManager, kv: FakeKV, req: FakeReq, chunk: int | None = None) -> bool:
    """Admit and prefill ``req`` (in chunks), checking its reused KV. False if no room."""
    match = mgr.match_prefix(req)
    n = len(req.all_token_ids) - match.num_tokens if chunk is None else min(chunk, len(req.all_token_ids) - match.num_tokens)
    if mgr.allocate_slots(req, match.num_tokens + n, match) is None:
        return False
    mgr.record_query(req, match)
    req.num_hit = match.num_tokens
    for c in mgr.take_pending_copies():
        kv.copy(c.src, c.dst, c.num_tokens)
    table = mgr.block_table(req.request_id)
    kv.check(table, req, match.num_tokens)
    kv.write(table, req, match.num_tokens, match.num_tokens + n)
    req.num_computed = match.num_tokens + n
    mgr.commit(req, req.num_computed)
    return True


def step(mgr: KVCacheManager, kv: FakeKV, req: FakeReq, new_token: int | None = None, chunk: int = 8) -> bool:
    """Prefill the next chunk, or decode one token (appending ``new_token``)."""
    if req.num_computed >= len(req.all_token_ids) - 1 and new_token is not None:
        req.all_token_ids.append(new_token)
    n = min(chunk, len(req.all_token_ids) - req.num_computed)
    if n <= 0:
        return True
    if mgr.allocate_slots(req, req.num_computed + n) is None:
        return False
    table = mgr.block_table(req.request_id)
    kv.write(table, req, req.num_computed, req.num_computed + n)
    req.num_computed += n
    mgr.commit(req, req.num_computed)
    kv.check(table, req, req.num_computed)
    return True
