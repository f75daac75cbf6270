"""The explorer through replicas (issue 23): merged figures are the sums of the replicas'."""

from __future__ import annotations

import pytest

from kvmosaic.serve.dashboard_merge import merge_states


def state(queries: int, hits: int, blocks: str, tenant: str, prefixes: int) -> dict:
    return {"time": 1.0, "backend": "hash", "block_size": 16, "show_text": False, "blocks": blocks, "loading": 0,
            "requests": {"running": 1, "waiting": 0, "loading": 0},
            "counters": {"queries": queries, "hits": hits, "tier_tokens": 0, "evictions": 0, "prompt_tokens": queries,
                         "generation_tokens": 3, "miss_tokens": {"cold": queries - hits, "namespace": 0}},
            "kv": {"num_blocks": len(blocks), "num_free_blocks": blocks.count("f"), "num_cached_blocks": blocks.count("c"),
                   "usage": blocks.count("u") / len(blocks)},
            "tenants": [{"tenant": tenant, "requests": 1, "queries": queries, "cached": hits, "computed": queries - hits,
                         "blocks_held": 2, "hit_rate": hits / queries}],
            "prefixes": [{"id": i, "parent": i - 1 if i else None, "start": 16 * i, "tokens": 16, "blocks": 1, "hits": 1,
                          "last_use_s": 0.0, "tenant": tenant} for i in range(prefixes)],
            "tiers": []}


def test_merge_sums_and_labels_by_replica():
    got = merge_states({"r1": state(100, 40, "ffcu", "t-a", 2), "r2": state(50, 10, "ccff", "t-a", 1)},
                       [{"time": 1.0, "path": "/v1/completions", "replica": "r2", "tenant": "t-a"}])
    assert got["counters"]["queries"] == 150 and got["counters"]["hits"] == 50
    assert got["counters"]["miss_tokens"] == {"cold": 100, "namespace": 0}
    assert got["blocks"] == "ffcuccff" and got["replica_blocks"] == {"r1": [0, 4], "r2": [4, 8]}
    assert got["kv"] == {"num_blocks": 8, "num_free_blocks": 4, "num_cached_blocks": 3, "usage": 1 / 8}
    assert got["tenants"] == [{"tenant": "t-a", "requests": 2, "queries": 150, "cached": 50, "computed": 100,
                               "blocks_held": 4, "hit_rate": 50 / 150}]
    assert [(p["id"], p["parent"], p["replica"]) for p in got["prefixes"]] == [(0, None, "r1"), (1, 0, "r1"), (2, None, "r2")]
    assert got["replicas"]["r2"]["queries"] == 50 and got["routes"][0]["replica"] == "r2"


def auto(requests: int, audits: int, over: int, counts: list[int], tenant: str) -> dict:
    return {"requests": requests, "tokens": 100 * requests, "fallbacks": 0, "repairs": 1, "audits": audits,
            "over_bound": over, "failed": 0, "audited_tokens": 16 * audits, "trips": 0, "namespaces_off": over > 1,
            "kl": {"buckets": [0.01, 0.03], "counts": counts, "sum": 0.02 * audits},
            "tenants": {tenant: {"audits": audits, "over_bound": over}},
            "bound": 0.03, "audit_rate": 1.0, "audit_tokens": 16}


def test_automatic_reuse_is_summed_over_the_replicas_that_run_it():
    r1, r2 = state(10, 0, "ff", "t-a", 0), state(10, 0, "ff", "t-b", 0)
    assert merge_states({"r1": r1, "r2": r2})["auto_reuse"] is None  # no replica runs it (older states: no key)
    r1["auto_reuse"], r2["auto_reuse"] = auto(3, 3, 1, [1, 1, 1], "t-a"), auto(4, 2, 2, [0, 0, 2], "t-b")
    got = merge_states({"r1": r1, "r2": r2})["auto_reuse"]
    assert (got["requests"], got["tokens"], got["audits"], got["over_bound"], got["audited_tokens"]) == (7, 700, 5, 3, 80)
    assert got["namespaces_off"] == 1 and got["repairs"] == 2
    assert got["kl"] == {"buckets": [0.01, 0.03], "counts": [1, 1, 3], "sum": pytest.approx(0.1)}
    assert got["tenants"] == {"t-a": {"audits": 3, "over_bound": 1}, "t-b": {"audits": 2, "over_bound": 2}}
    assert (got["bound"], got["audit_rate"], got["audit_tokens"]) == (0.03, 1.0, 16)
