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
