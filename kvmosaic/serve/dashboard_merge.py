"""The cache explorer through ``--replicas`` (issue 23): one state from every replica's.

:func:`merge_states` sums the counters, the pools' sizes and the per-tenant figures over the
replicas (so the page's figures equal the front's merged ``/metrics`` summed over the
``replica`` label), puts the block maps side by side (``replica_blocks`` says which range is
whose), labels every cached prefix with the replica holding it, and adds ``routes``: where the
front sent its last requests. Pure data in, data out; the front gathers the states.
"""

from __future__ import annotations

from ..server.metrics_cache import hit_rate

SUMMED = ("queries", "hits", "tier_tokens", "evictions", "prompt_tokens", "generation_tokens")
AUTO_SUMMED = ("requests", "tokens", "fallbacks", "repairs", "audits", "over_bound", "failed", "audited_tokens",
               "trips", "namespaces_off")


def merge_auto_reuse(parts: list[dict | None]) -> dict | None:
    """Automatic reuse's figures (``dashboard_state.auto_reuse_figures``) summed over the replicas that
    run it; its settings are the first's (every replica gets the same engine arguments)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = {**parts[0], **{k: sum(p[k] for p in parts) for k in AUTO_SUMMED}}
    out["kl"] = {"buckets": parts[0]["kl"]["buckets"], "sum": sum(p["kl"]["sum"] for p in parts),
                 "counts": [sum(c) for c in zip(*(p["kl"]["counts"] for p in parts))]}
    tenants: dict[str, dict] = {}
    for p in parts:
        for label, fig in p["tenants"].items():
            acc = tenants.setdefault(label, {"audits": 0, "over_bound": 0})
            acc["audits"] += fig["audits"]
            acc["over_bound"] += fig["over_bound"]
    out["tenants"] = tenants
    return out


def merge_states(states: dict[str, dict], routes: list[dict] | None = None) -> dict:
    """``states``: replica id -> its ``/dashboard/state``, in a stable order."""
    if not states:
        return {"replicas": {}, "routes": routes or [], "blocks": "", "prefixes": [], "tenants": [], "tiers": []}
    first = next(iter(states.values()))
    counters = {k: sum(s["counters"].get(k, 0) for s in states.values()) for k in SUMMED}
    counters["miss_tokens"] = {}
    for s in states.values():
        for r, n in s["counters"]["miss_tokens"].items():
            counters["miss_tokens"][r] = counters["miss_tokens"].get(r, 0) + n
    kv = {k: sum(s["kv"][k] for s in states.values()) for k in ("num_blocks", "num_free_blocks", "num_cached_blocks")}
    kv["usage"] = sum(s["kv"]["usage"] * s["kv"]["num_blocks"] for s in states.values()) / max(1, kv["num_blocks"])
    tenants: dict[str, dict] = {}
    for s in states.values():
        for t in s["tenants"]:
            acc = tenants.setdefault(t["tenant"], {"tenant": t["tenant"], "requests": 0, "queries": 0, "cached": 0,
                                                   "computed": 0, "blocks_held": 0})
            for k in ("requests", "queries", "cached", "computed", "blocks_held"):
                acc[k] += t[k]
    for acc in tenants.values():
        acc["hit_rate"] = hit_rate(acc)
    blocks, ranges, prefixes, tiers = [], {}, [], []
    offset = 0
    for rid, s in states.items():
        ranges[rid] = [offset, offset + len(s["blocks"])]
        offset += len(s["blocks"])
        blocks.append(s["blocks"])
        base = len(prefixes)
        for n in s["prefixes"]:
            prefixes.append({**n, "id": base + n["id"], "parent": None if n["parent"] is None else base + n["parent"],
                             "replica": rid})
        tiers += [{**t, "name": f"{rid}/{t['name']}"} for t in s["tiers"]]
    return {
        "time": max(s["time"] for s in states.values()),
        "backend": first["backend"], "block_size": first["block_size"], "show_text": first["show_text"],
        "blocks": "".join(blocks), "replica_blocks": ranges,
        "loading": sum(s["loading"] for s in states.values()),
        "requests": {k: sum(s["requests"][k] for s in states.values()) for k in ("running", "waiting", "loading")},
        "counters": counters, "kv": kv,
        "tenants": sorted(tenants.values(), key=lambda t: -t["queries"]),
        "prefixes": prefixes, "tiers": tiers,
        "auto_reuse": merge_auto_reuse([s.get("auto_reuse") for s in states.values()]),
        "replicas": {rid: {"running": s["requests"]["running"], "waiting": s["requests"]["waiting"],
                           "queries": s["counters"]["queries"], "hits": s["counters"]["hits"],
                           "cached_blocks": s["kv"]["num_cached_blocks"], "prefixes": len(s["prefixes"])}
                     for rid, s in states.items()},
        "routes": routes or [],
    }
