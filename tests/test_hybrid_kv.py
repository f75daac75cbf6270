"""The hybrid KV layout's bookkeeping (cache/kv_groups.py, cache/hybrid.py), model-free.

Each page slot of a fake KV store holds the token history of the token written there, per
group; a request reads, for every query it computes, the slots its layers see (the window for
window groups, the whole context for full ones) and checks each holds its own history. So a
window block given back too early, a hit that hands out a page it does not hold, or a page
shared across groups shows up as wrong KV; the pool's invariant 2 is checked after every
operation and the pool is idle (nothing in use) at the end.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import pytest

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hybrid import HybridCacheManager, group_key
from kvmosaic.cache.kv_groups import KVGroup, KVLayout
from kvmosaic.cache.manager import PlainRequest

SEED = b"\x01" * 32
BS = 4


def sha(o) -> bytes:
    return hashlib.sha256(repr(o).encode()).digest()


@dataclass
class Req(PlainRequest):
    num_computed_tokens: int = 0


def test_plan_groups_layers_by_attention_type():
    gemma3 = [8, 8, 8, 8, 8, None] * 2
    layout = KVLayout.plan(gemma3)
    assert layout.page_layers == 2
    assert layout.groups[0] == KVGroup(None, (5, 11))  # full first: group 0 publishes plain hashes
    assert [g.layers for g in layout.groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert sorted(layout.group_of) == sorted(layout.group_of) and len(layout.group_of) == 12
    assert {(layout.group_of[i], layout.row_of[i]) for i in range(12)} == {(g, r) for g in range(6) for r in range(2)}
    assert KVLayout.plan([None, None]) == KVLayout.full(2) and not KVLayout.full(2).hybrid
    mistral = KVLayout.plan([32] * 3)
    assert mistral.hybrid and mistral.groups == (KVGroup(32, (0, 1, 2)),) and mistral.page_layers == 3
    assert mistral.pages_for(10) == 10 and layout.pages_for(10) == 60  # the same memory either way
    assert [mistral.first_live_block(0, p, BS) for p in (0, 32, 35, 36, 40)] == [0, 0, 1, 1, 2]


class FakeKV:
    """page id -> slot -> history of the token whose KV is there."""

    def __init__(self) -> None:
        self.slots: dict[int, dict[int, tuple]] = {}

    def write(self, mgr: HybridCacheManager, req: Req, start: int, end: int) -> None:
        for table in mgr.block_tables(req.request_id):
            for p in range(start, end):
                self.slots.setdefault(table[p // BS], {})[p % BS] = tuple(req.all_token_ids[: p + 1])

    def check_reads(self, mgr: HybridCacheManager, req: Req, start: int, end: int) -> None:
        """Queries ``start .. end-1`` read their past (``< start``) in every group."""
        for g, table in enumerate(mgr.block_tables(req.request_id)):
            w = mgr.layout.groups[g].window
            lo = 0 if w is None else max(0, start - w + 1)
            for p in range(lo, start):
                got = self.slots.get(table[p // BS], {}).get(p % BS)
                assert got == tuple(req.all_token_ids[: p + 1]), f"group {g}: wrong KV at {p}"


def step(mgr: HybridCacheManager, kv: FakeKV, req: Req, n: int, match=None) -> bool:
    """Compute ``n`` more tokens of ``req`` (admitting it with ``match`` first)."""
    if match is not None:
        req.num_computed_tokens = match.num_tokens
    start = req.num_computed_tokens
    if mgr.allocate_slots(req, start + n, match) is None:
        return False
    kv.check_reads(mgr, req, start, start + n)
    kv.write(mgr, req, start, start + n)
    req.num_computed_tokens += n
    mgr.commit(req, req.num_computed_tokens)
    mgr.pool.check_invariants()
    return True


def evict(pool: BlockPool, block) -> None:
    """Evict one evictable block, as the pool does when memory is needed."""
    pool.evictor.remove(block)
    pool.uncache_block(block)
    pool.free_queue.append(block)


def manager(windows, num_blocks=200, caching=True) -> HybridCacheManager:
    return HybridCacheManager(BlockPool(num_blocks, BS), SEED, sha, KVLayout.plan(windows), caching)


def test_all_windowed_request_holds_its_window_only():
    mgr, kv = manager([10, 10]), FakeKV()
    req = Req("a", list(range(200)))
    assert step(mgr, kv, req, 6, mgr.match_prefix(req))
    while req.num_computed_tokens < 200:
        assert step(mgr, kv, req, 1)
        # the window's blocks, the one being written among them: ceil((W - 1) / B) + 1 = 4 here
        assert len(mgr.held_pages("a")) <= -(-(10 - 1) // BS) + 1
    mgr.free(req)
    assert mgr.size_info().in_use == 0
    mgr.pool.check_invariants()


def test_windowed_hit_needs_only_the_window_and_survives_eviction_of_early_blocks():
    mgr, kv = manager([None, 10, 10]), FakeKV()
    a = Req("a", list(range(60)))
    assert step(mgr, kv, a, 60, mgr.match_prefix(a))
    mgr.free(a)
    # Evict block 0..5 of the window group (vLLM's users see 0% hits once early blocks are gone).
    hashes = mgr.new_hasher().update(a.all_token_ids)
    for i in range(6):
        evict(mgr.pool, mgr.pool.cached[group_key(hashes[i], 1)])
    b = Req("b", list(range(50)) + [999] * 9)
    match = mgr.match_prefix(b)
    assert match.num_tokens == 48  # 12 blocks: the full group's chain, the window group's last 3
    window = match.group_blocks[1]
    assert window[:9] == [None] * 9 and all(x is not None for x in window[9:12])
    assert all(x is not None for x in match.group_blocks[0])
    assert step(mgr, kv, b, 11, match)
    mgr.free(b)
    # A gap inside the window cuts the hit back to the last point whose window is whole.
    evict(mgr.pool, mgr.pool.cached[group_key(hashes[10], 1)])
    c = Req("c", list(range(50)) + [7] * 3)
    assert mgr.match_prefix(c).num_tokens == 40  # needs blocks 7..9 (positions 31..39)
    mgr.hashers.clear()
    assert mgr.size_info().in_use == 0


def test_groups_never_share_a_page_and_group_zero_publishes_the_plain_chain():
    mgr, kv = manager([None, 8]), FakeKV()
    mgr.pool.events.enabled = True
    a = Req("a", list(range(20)))
    assert step(mgr, kv, a, 20, mgr.match_prefix(a))
    hashes = mgr.new_hasher().update(a.all_token_ids)
    events = mgr.pool.events.drain()[0]
    stored = {h: (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
              for e in events for h in e.block_hashes}
    assert all(stored[h] == (0, "full_attention", None) for h in hashes)
    assert all(stored[group_key(h, 1)] == (1, "sliding_window", 8) for h in hashes)
    from kvmosaic.server.events import to_wire  # the wire format (vLLM's fields) says it too

    wire = to_wire(next(e for e in events if e.block_hashes == [group_key(hashes[0], 1)]))
    assert (wire.group_idx, wire.kv_cache_spec_kind, wire.kv_cache_spec_sliding_window) == (1, "sliding_window", 8)
    pages = [p for _, p in mgr.held_pages("a")]
    assert len(pages) == len(set(pages))
    mgr.free(a)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_kv_exact_and_accounting_whole(seed):
    """Requests sharing prefixes, chunked prefill, decodes, forks, preemption under pressure:
    every read sees its own history, invariant 2 holds after every step, nothing is left in use."""
    rng = random.Random(seed)
    windows = rng.choice([[9, 9], [None, 9, 9, 9, 9, 9], [None, 6]])
    mgr, kv = manager(windows, num_blocks=rng.choice([30, 60]), caching=seed % 3 != 2), FakeKV()
    bases = [[rng.randrange(5) for _ in range(40)] for _ in range(2)]
    live: list[Req] = []
    for i in range(60):
        if len(live) < 4 and rng.random() < 0.5:
            base = rng.choice(bases)
            req = Req(f"r{i}", base[: rng.randrange(1, 40)] + [rng.randrange(5) for _ in range(rng.randrange(1, 12))])
            if step(mgr, kv, req, rng.randrange(1, 16) if len(req.all_token_ids) > 16 else
                    len(req.all_token_ids) - mgr.match_prefix(req).num_tokens, mgr.match_prefix(req)):
                live.append(req)
            else:
                mgr.free(req)
            continue
        if not live:
            continue
        req = rng.choice(live)
        left = len(req.all_token_ids) - req.num_computed_tokens
        if left == 0:
            if rng.random() < 0.2 and req.num_computed_tokens % BS:
                child = Req(f"{req.request_id}c{i}", list(req.all_token_ids), num_computed_tokens=req.num_computed_tokens)
                if mgr.fork(req, child, req.num_computed_tokens):
                    for c in mgr.take_pending_copies():
                        kv.slots[c.dst] = {k: v for k, v in kv.slots.get(c.src, {}).items() if k < c.num_tokens}
                    live.append(child)
                continue
            req.all_token_ids.append(rng.randrange(5))
            left = 1
        else:
            for c in mgr.take_pending_copies():
                kv.slots[c.dst] = {k: v for k, v in kv.slots.get(c.src, {}).items() if k < c.num_tokens}
        if not step(mgr, kv, req, min(left, rng.randrange(1, 10))) or rng.random() < 0.1:
            mgr.free(req)  # preempted, or finished
            live.remove(req)
        mgr.pool.check_invariants()
    for req in live:
        mgr.free(req)
    mgr.pool.check_invariants()
    assert mgr.size_info().in_use == 0 and not mgr.tables


def test_pinned_prefix_keeps_the_pages_a_hit_needs():
    mgr, kv = manager([None, 8], num_blocks=40), FakeKV()
    a = Req("a", list(range(41)))
    assert step(mgr, kv, a, 41, mgr.match_prefix(a))
    mgr.free(a)
    pin = mgr.pin_prefix(list(range(40)))
    assert pin.num_tokens == 40 and pin.num_blocks == 10 + 2  # the full group's 10, the window's last 2
    # memory pressure: every unpinned page is taken and its content evicted
    hog = Req("hog", [99] * 4 * ((mgr.pool.num_free_blocks - 2) // 2))  # all but two pages
    assert step(mgr, kv, hog, len(hog.all_token_ids), mgr.match_prefix(hog))
    b = Req("b", list(range(40)) + [5])
    assert mgr.match_prefix(b).num_tokens == 40
    assert step(mgr, kv, b, 1, mgr.match_prefix(b))
    for r in (hog, b):
        mgr.free(r)
    mgr.unpin(pin.pin_id)
    mgr.pool.check_invariants()
    assert mgr.size_info().in_use == 0

