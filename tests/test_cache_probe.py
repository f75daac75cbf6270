"""The dashboard's live explain reads the cache without changing it (issue 23), and the
per-tenant metrics keep a bounded set of labels."""

from __future__ import annotations

import random

import pytest
from test_miss_reasons import BACKENDS, Rig, toks

from kvmosaic.cache.probe import probe
from kvmosaic.server.metrics_cache import top_tenants


def fingerprint(rig: Rig) -> tuple:
    mgr = rig.mgr
    blocks = tuple((b.block_id, b.ref_cnt, b.hits, b.last_access, b.block_hash) for b in mgr.pool.blocks)
    order = tuple(b.block_id for b in mgr.pool.evictor)
    tree = getattr(mgr, "tree", None)
    nodes = tuple(sorted((n.start, len(n.key), n.hits, n.last_access, n.lock_ref) for n in tree._nodes())) if tree else ()
    watch = (dict(rig.watch.parent_of), tuple(rig.watch.ghosts), {k: list(v) for k, v in rig.watch.owner.items()})
    return (blocks, order, nodes, watch, dict(mgr.hashers), vars(mgr.stats).copy(), dict(rig.lens.miss_tokens),
            mgr.pool.num_evictions)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe_changes_nothing_and_explains_block_by_block(backend):
    rng = random.Random(9)
    rig = Rig(backend, num_blocks=24)
    a = toks(rng, 70)
    rig.run([a, toks(rng, 40)])
    rig.run([toks(rng, 200)])  # evicts some of a
    rig.run([a[:40] + toks(rng, 30)])
    before = fingerprint(rig)
    got = probe(rig.mgr, rig.watch, a + toks(rng, 20))
    assert fingerprint(rig) == before
    assert sum(got["missed"].values()) == got["num_tokens"] - got["pool_tokens"] - got["tier_tokens"]
    assert [b["where"] for b in got["blocks"]][: got["pool_tokens"] // 16] == ["pool"] * (got["pool_tokens"] // 16)
    assert got["stop"]["token"] == got["pool_tokens"]
    per_block = {}
    for b in got["blocks"]:
        for r, n in b["reasons"].items():
            per_block[r] = per_block.get(r, 0) + n
    assert per_block == got["missed"]
    other = probe(rig.mgr, rig.watch, a, cache_salt="someone-else")
    assert other["pool_tokens"] == 0 and other["stop"]["token"] == 0


def test_top_tenants_bounds_the_labels():
    tenants = {f"t-{i:02d}": {"requests": 1, "queries": i, "cached": i // 2, "computed": i - i // 2, "blocks_held": 1}
               for i in range(30)}
    tenants["other"] = {"requests": 5, "queries": 7, "cached": 1, "computed": 6, "blocks_held": 2}
    top = top_tenants(tenants, 10)
    assert len(top) == 11 and list(top)[:3] == ["t-29", "t-28", "t-27"]
    assert sum(f["queries"] for f in top.values()) == sum(f["queries"] for f in tenants.values())
    assert top["other"]["blocks_held"] == 20 + 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_prefixes_carry_token_text_only_when_asked(backend):
    from types import SimpleNamespace

    from kvmosaic.server.dashboard_state import block_map, hash_prefixes, radix_prefixes

    rng = random.Random(11)
    rig = Rig(backend)
    rig.watch.keep_tokens = True
    a = toks(rng, 70)
    rig.run([a], tenant="t-1")
    rig.run([a[:40] + toks(rng, 40)], tenant="t-1")
    engine = SimpleNamespace(pool=rig.mgr.pool, watch=rig.watch, cache=rig.mgr, scheduler=rig.sched)
    build = radix_prefixes if backend == "radix" else hash_prefixes
    hidden, shown = build(engine, False, 100), build(engine, True, 100)
    assert all("tokens_ids" not in n for n in hidden)
    assert shown[0]["tokens_ids"] == a[: len(shown[0]["tokens_ids"])] and all(n["tenant"] == "t-1" for n in shown)
    roots = [n for n in hidden if n["parent"] is None]
    assert len(roots) == 1 and len(hidden) == 3  # a shared head, then the two continuations
    assert sum(n["blocks"] for n in hidden) >= 4
    assert set(block_map(engine)) <= {"f", "c"}  # nothing running: free or cached
