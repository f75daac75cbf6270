"""Router units: the index (gaps, resets, death), policies, prompt hashes equal the engine's,
the simulator on a tiny config, and the torch-free import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.events import EventLog
from kvmosaic.cache.hash_manager import HashCacheManager
from kvmosaic.cache.manager import PlainRequest
from kvmosaic.router import (
    CacheAware,
    ClusterIndex,
    Match,
    PromptHasher,
    ReplicaLoad,
    RouteRequest,
    make_policy,
)
from kvmosaic.router.index import tier_credit
from kvmosaic.server.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

H = PromptHasher.for_model("fp", "bfloat16", 4, "sha256_cbor")


def stored(hashes, medium=None):
    return BlockStored(list(hashes), None, [0] * 4 * len(hashes), 4, None, medium)


def test_router_imports_without_torch():
    code = "import sys, kvmosaic.router; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_prompt_hashes_equal_the_engines():
    tokens = list(range(3, 40))
    for salt in (None, "tenant-1"):
        mgr = HashCacheManager(BlockPool(32, 4), H.seed, H.hash_fn)
        req = PlainRequest("r", tokens, salt)
        assert H.hashes(tokens, salt, reusable_only=False) == mgr.hasher(req).update(tokens)
    assert len(H.hashes(tokens[:8])) == 1  # the last token is always recomputed
    assert H.hashes(tokens, "a") != H.hashes(tokens, "b")


def test_index_follows_a_real_pool_with_gaps_resets_and_death():
    pool = BlockPool(8, 4, events=EventLog(enabled=True))
    mgr = HashCacheManager(pool, H.seed, H.hash_fn)
    index = ClusterIndex(4)
    seq = 0
    for i in range(6):  # eviction pressure: 6 requests x 3 blocks in 8 blocks
        req = PlainRequest(f"r{i}", [i * 100 + t for t in range(13)])
        m = mgr.match_prefix(req)
        mgr.allocate_slots(req, 13, m)
        mgr.commit(req, 13)
        mgr.free(req)
        evs = pool.events.drain()
        evs = evs[0] if isinstance(evs, tuple) else evs
        from kvmosaic.server.events import to_wire
        index.apply("r0", seq, KVEventBatch(0.0, [to_wire(e) for e in evs]), now=0.0)
        seq += 1
    assert index.cached_hashes("r0") == set(pool.cached)
    chain = H.hashes([500 + t for t in range(13)])
    assert index.match(chain, expected=False)["r0"].blocks == 3
    # a duplicate is ignored; a jump is a gap and makes the view stale
    assert not index.apply("r0", seq - 1, KVEventBatch(0.0, []), now=0.0)
    index.apply("r0", seq + 2, KVEventBatch(0.0, [BlockRemoved([chain[0]], None)]), now=0.0)
    assert index.replicas["r0"].gaps == 2 and not index.fresh("r0")
    index.apply("r0", seq + 3, KVEventBatch(0.0, [AllBlocksCleared()]), now=0.0)
    assert index.fresh("r0") and not index.holders
    # a restart (numbering begins again) resets the view; death drops its entries
    index.apply("r0", 0, KVEventBatch(0.0, [stored(chain)]), now=0.0)
    assert index.cached_hashes("r0") == set(chain) and index.replicas["r0"].resets == 1
    index.remove_replica("r0")
    assert not index.holders and "r0" not in index.replicas


def test_tier_credit_and_expectations():
    index = ClusterIndex(4, clock=lambda: 0.0)
    chain = H.hashes(list(range(3, 30)))
    index.apply("a", 0, KVEventBatch(0.0, [stored(chain, "disk")]), now=0.0)
    index.apply("b", 0, KVEventBatch(0.0, [stored(chain[:2], "GPU")]), now=0.0)
    m = index.match(chain)
    assert m["a"].blocks == len(chain) and m["a"].credit_tokens == 0.5 * 4 * len(chain)
    assert m["b"].blocks == 2 and m["b"].credit_tokens == 8
    index.expect("c", chain, ttl_s=1.0, now=0.0)
    assert index.match(chain)["c"].blocks == len(chain) and "c" not in index.match(chain, expected=False)


def test_a_shared_tier_credits_every_replica_that_has_it():
    """A block in Redis (a shared tier) is held, at Redis's credit, by every replica that announced
    Redis; its writer keeps its pool credit; a replica without Redis gets nothing."""
    index = ClusterIndex(4, clock=lambda: 0.0)
    chain = H.hashes(list(range(3, 30)))  # 6 blocks
    n, redis = len(chain), tier_credit("redis")
    assert redis < tier_credit("CPU")
    # a computes the prompt: pool first, then the write-through to Redis
    index.apply("a", 0, KVEventBatch(0.0, [stored(chain, "CPU"), stored(chain, "redis")]), now=0.0)
    # b has the Redis tier (it wrote some other block there) and holds chain's first 2 blocks in
    # its pool; c has no Redis tier
    other = H.hashes(list(range(500, 510)))
    index.apply("b", 0, KVEventBatch(0.0, [stored(other, "CPU"), stored(other, "redis"),
                                          stored(chain[:2], "CPU")]), now=0.0)
    index.apply("c", 0, KVEventBatch(0.0, [stored(other, "CPU")]), now=0.0)
    m = index.match(chain, expected=False)
    assert set(m) == {"a", "b"}
    assert m["a"] == Match(n, 4.0 * n)  # the writer: its pool, not the tier it also wrote
    assert m["b"] == Match(n, 4 * (2 + redis * (n - 2)))
    assert index.match(chain, ["b", "c"], expected=False)["b"].blocks == n
    assert index.match(other, expected=False)["a"].blocks == len(other)  # a has Redis too
    # the cache-aware policy predicts the Redis blocks for b
    pol = CacheAware(index, H, expect_ttl_s=0)
    req = RouteRequest("1", list(range(3, 30)), hashes=chain)
    assert pol.choose(req, [ReplicaLoad("a", 10_000), ReplicaLoad("b", 0)]) == ("b", "cache_hit")
    assert req.predicted_cached_tokens == 4 * n
    # a's pool evicts the chain's tail: Redis still holds it while the index knows the block
    index.apply("a", 1, KVEventBatch(0.0, [BlockRemoved(chain[4:], "CPU")]), now=0.0)
    assert index.match(chain, expected=False)["b"].blocks == 4  # the tail left with its last holder
    # Redis dropped block 3 (corrupt, announced): gone for every replica sharing it
    index.apply("a", 2, KVEventBatch(0.0, [BlockRemoved([chain[3]], "redis")]), now=0.0)
    assert index.match(chain, expected=False)["b"] == Match(3, 4 * (2 + redis))
    # the writer dies: nothing of its announcements is left behind
    index.remove_replica("a")
    assert index.match(chain, expected=False)["b"] == Match(2, 8.0)
    assert set(index.shared) == set(other) | set(chain[:2]) and index.sharing["redis"] == {"b"}
    index.apply("b", 1, KVEventBatch(0.0, [AllBlocksCleared()]), now=0.0)
    assert set(index.shared) == set(other)  # c's pool still holds them
    assert index.match(other, expected=False)["b"].blocks == len(other)
    index.remove_replica("c")
    assert not index.shared and not index.holders and index.replicas["b"].shared_media == {"redis"}


def test_cache_aware_prefers_holder_balances_when_loaded_and_falls_back_when_stale():
    index = ClusterIndex(4, clock=lambda: 0.0)
    pol = CacheAware(index, H, load_bound_tokens=1000, expect_ttl_s=0)
    toks = list(range(3, 60))
    index.apply("b", 0, KVEventBatch(0.0, [stored(H.hashes(toks))]), now=0.0)
    index.add_replica("a")
    reps = [ReplicaLoad("a", 0, 0), ReplicaLoad("b", 20, 1)]
    assert pol.choose(RouteRequest("1", toks), reps) == ("b", "cache_hit")
    assert pol.choose(RouteRequest("2", toks), [ReplicaLoad("a", 2000), ReplicaLoad("b", 3000)]) == ("a", "load_balance")
    index.apply("b", 5, KVEventBatch(0.0, []), now=0.0)  # gap: b is stale
    index.replicas["a"].stale = True
    assert pol.choose(RouteRequest("3", toks), reps) == ("a", "fallback")


def test_simple_policies():
    reps = [ReplicaLoad("a", 10), ReplicaLoad("b", 0), ReplicaLoad("c", 5)]
    rr = make_policy("round-robin")
    assert [rr.choose(RouteRequest(str(i), [1]), reps)[0] for i in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("least-loaded").choose(RouteRequest("x", [1]), reps)[0] == "b"
    tree = make_policy("approximate-tree")
    first, _ = tree.choose(RouteRequest("1", list(range(64))), reps)
    assert tree.choose(RouteRequest("2", list(range(64)) + [9]), reps) == (first, "cache_hit")


def test_simulator_tiny(tmp_path):
    from kvmosaic.sim.report import run_grid

    rows = run_grid([4], 6, tmp_path)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"round-robin", "least-loaded", "approximate-tree", "cache-aware", "oracle"}
    assert by["cache-aware"]["hit_rate"] >= by["round-robin"]["hit_rate"]
    assert (tmp_path / "sim.md").exists() and (tmp_path / "sim.json").exists()


def test_every_replica_runs_serve_in_low_latency_mode_with_direct_ingress_as_decided():
    """Both deployments carry Serve's low-latency settings in their runtime env (so a joined
    cluster's replicas get them too); direct ingress only where ``kvmosaic serve`` starts Ray."""
    from kvmosaic.engine.arg_utils import EngineArgs
    from kvmosaic.serve.app import build_application
    from kvmosaic.server.args import ServerArgs

    for server, direct in ((ServerArgs(replicas=2), "1"), (ServerArgs(replicas=2, direct_ingress=False), "0"),
                           (ServerArgs(replicas=2, ray_address="ray://10.0.0.1:10001"), "0")):
        front = build_application(EngineArgs(), server)._bound_deployment
        engines = front.init_args[0]._bound_deployment
        for deployment in (front, engines):
            env = deployment.ray_actor_options["runtime_env"]["env_vars"]
            assert env == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": direct}


def test_an_app_built_from_a_serve_config_goes_through_serves_proxy():
    """``build_app`` (``serve run config.yaml``): no direct ingress, whose port and draining period
    only ``kvmosaic serve`` sets up (left on, every shutdown waited out Serve's 20 s grace period);
    asking for it there is an error that says why."""
    from kvmosaic.serve.app import build_app

    front = build_app({"replicas": 2})._bound_deployment
    for deployment in (front, front.init_args[0]._bound_deployment):
        assert deployment.ray_actor_options["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    with pytest.raises(ValueError, match="Serve's HTTP proxy"):
        build_app({"replicas": 2, "direct-ingress": True})


def test_a_repeat_before_any_event_goes_where_the_first_went():
    """No replica has published yet (no view is fresh): the first prompt falls back to least
    loaded, and the router's own record of it sends a repeat, sent before the events arrive,
    to the same replica; another prompt still rotates."""
    index = ClusterIndex(4, clock=lambda: 0.0)
    pol = CacheAware(index, H, expect_ttl_s=30.0)
    idle = [ReplicaLoad("a", 0), ReplicaLoad("b", 0)]
    first, reason = pol.choose(RouteRequest("1", list(range(3, 30))), idle)
    assert reason == "fallback"
    for i in range(2, 6):
        req = RouteRequest(str(i), list(range(3, 30)))
        assert pol.choose(req, idle) == (first, "cache_hit") and req.predicted_cached_tokens == 24
    others = {pol.choose(RouteRequest(str(i), list(range(100 + i, 140 + i))), idle)[0] for i in range(4)}
    assert others == {"a", "b"}


def test_a_prompt_routed_before_the_hashing_facts_is_expected_where_it_went_once_they_arrive():
    """The first request can come before any replica has reported the model's hashing facts (the
    router then cannot hash it: fallback); once they arrive, that prompt is expected where it went,
    so its repeat goes there too (a cluster's first tenant split over two replicas in CI without
    this), and one whose time ran out is not."""
    now = [0.0]
    index = ClusterIndex(4, clock=lambda: now[0])
    pol = CacheAware(index, None, expect_ttl_s=30.0)
    idle = [ReplicaLoad("a", 0), ReplicaLoad("b", 0)]
    first, reason = pol.choose(RouteRequest("1", list(range(3, 30))), idle)
    pol.choose(RouteRequest("2", list(range(200, 230))), idle)
    assert reason == "fallback"
    now[0] = 20.0
    pol.set_hasher(H)
    for i in range(3, 6):
        req = RouteRequest(str(i), list(range(3, 30)))
        assert pol.choose(req, idle) == (first, "cache_hit") and req.predicted_cached_tokens == 24
    now[0] = 31.0  # the second prompt's expectation (routed at 0) has run out; the first's repeats renewed it
    assert pol.choose(RouteRequest("6", list(range(3, 30))), idle) == (first, "cache_hit")
    assert pol.choose(RouteRequest("7", list(range(200, 230))), idle)[1] != "cache_hit"
