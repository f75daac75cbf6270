"""Both backends publish the same cache events from the pool: a subscriber's view equals the
pool's content index after any workload with eviction, and a radix replica names its blocks
with the same chain hashes as a hash replica (docs/ARCHITECTURE.md, "One event path")."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
from radix_sim import SEED, FakeKV, FakeReq, admit, step

from kvmosaic.cache import events as ce
from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.hashing import BlockHasher, CacheNamespace, get_hash_fn
from kvmosaic.cache.manager import KVCacheManager
from kvmosaic.cache.radix import RadixCacheManager
from kvmosaic.server.events import CachedBlocks, KVEventBatch, to_wire

BS = 4
HASH = get_hash_fn("sha256_cbor")


def manager(kind: str, num_blocks: int, log: ce.EventLog) -> KVCacheManager:
    pool = BlockPool(num_blocks, BS, events=log)
    if kind == "radix":
        return RadixCacheManager(pool, SEED, hash_fn=HASH)
    return HashCacheManager(pool, SEED, HASH)


def follow(view: CachedBlocks, log: ce.EventLog) -> list:
    events, dropped = log.drain()
    assert dropped == 0
    view.apply(KVEventBatch(time.time(), [to_wire(e) for e in events]))
    return events


def random_workload(kind: str, seed: int):
    """Requests from a few shared prefixes, chunked prefill, decode, frees, in a pool small
    enough to evict; after every operation the follower must agree with the pool."""
    rng = random.Random(seed)
    log = ce.EventLog(enabled=True)
    mgr = manager(kind, 24, log)
    kv, view = FakeKV(BS), CachedBlocks()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    running: list[FakeReq] = []
    stored = []
    for i in range(120):
        op = rng.random()
        if op < 0.4 or not running:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            req = FakeReq(f"r{i}", tokens, cache_salt=rng.choice([None, None, "t"]))
            if admit(mgr, kv, req, chunk=rng.choice([None, 5])):
                running.append(req)
        elif op < 0.75:
            req = rng.choice(running)
            if not step(mgr, kv, req, new_token=rng.randrange(50)):
                running.remove(req)
                mgr.free(req)
        else:
            req = running.pop(rng.randrange(len(running)))
            mgr.free(req)
        stored += [e for e in follow(view, log) if isinstance(e, ce.BlockStored)]
        assert set(view.parent) == set(mgr.pool.cached), f"step {i}: the follower disagrees with the pool"
        mgr.pool.check_invariants()
    for req in running:
        mgr.free(req)
    follow(view, log)
    assert set(view.parent) == set(mgr.pool.cached)
    return mgr, stored


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_follower_view_equals_pool_under_eviction(kind):
    evictions = 0
    for seed in range(6):
        mgr, stored = random_workload(kind, seed)
        evictions += mgr.pool.num_evictions
        assert stored, "the workload cached nothing"
    assert evictions > 0, "the pool never evicted: the test did not exercise eviction"


def test_radix_names_blocks_with_the_hash_chain():
    """Every block a radix replica announces carries the chain hash the hash backend (and a
    router) computes for the same tokens, with the right parent."""
    _, stored = random_workload("radix", 3)
    seen: dict[bytes, bytes | None] = {}
    for ev in stored:
        seen[ev.block_hashes[0]] = ev.parent_block_hash
        assert len(ev.token_ids) == BS and ev.medium == "CPU"
    # Rebuild each announced block's chain from its ancestors' tokens.
    tokens_of = {e.block_hashes[0]: e.token_ids for e in stored}
    for h in seen:
        path = [h]
        while seen.get(path[-1]) is not None:
            path.append(seen[path[-1]])
        tokens = [t for b in reversed(path) for t in tokens_of[b]]
        chains = [BlockHasher(CacheNamespace(SEED, salt), BS, HASH).update(tokens) for salt in (None, "t")]
        assert any(c[-1] == h for c in chains)


def test_radix_eviction_is_counted_and_announced():
    log = ce.EventLog(enabled=True)
    mgr = manager("radix", 6, log)
    kv, view = FakeKV(BS), CachedBlocks()
    for i in range(6):
        req = FakeReq(f"r{i}", [i * 100 + t for t in range(13)])
        assert admit(mgr, kv, req)
        mgr.free(req)
        follow(view, log)
    assert mgr.pool.num_evictions > 0
    assert set(view.parent) == set(mgr.pool.cached)


def test_reset_clears_the_follower():
    for kind in ("hash", "radix"):
        log = ce.EventLog(enabled=True)
        mgr = manager(kind, 16, log)
        kv, view = FakeKV(BS), CachedBlocks()
        req = FakeReq("a", list(range(11)))
        admit(mgr, kv, req)
        mgr.free(req)
        follow(view, log)
        assert len(view) == 2
        assert mgr.reset_prefix_cache()
        follow(view, log)
        assert len(view) == 0 and not mgr.pool.cached


def test_dropped_events_are_counted_and_show_as_a_gap():
    log = ce.EventLog(enabled=True, max_pending=2)
    for i in range(5):
        log.emit(ce.BlockRemoved([bytes([i])]))
    events, dropped = log.drain()
    assert len(events) == 2 and dropped == 3 and log.num_dropped == 3
    zmq = pytest.importorskip("zmq")
    from kvmosaic.server.events import KVEventSubscriber, ZmqEventPublisher
    from kvmosaic.server.launch import free_port

    pub_port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    try:
        time.sleep(0.3)  # let the subscription reach the publisher
        pub.publish(events)  # seq 0
        pub.publish([ce.BlockRemoved([b"x"])], dropped=dropped)  # seq 1 skipped, seq 2 sent
        got = [sub.recv(timeout=5), sub.recv(timeout=5)]
        assert [g[0] for g in got] == [0, 2]
        assert sub.gaps == 1 and pub.num_skipped == 1
    finally:
        sub.close()
        pub.close()
    del zmq


def test_cache_and_subscriber_import_without_torch():
    code = ("import sys, kvmosaic.cache, kvmosaic.cache.manager, kvmosaic.cache.hash_manager, kvmosaic.cache.radix,"
            " kvmosaic.server.events;"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
