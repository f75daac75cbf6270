"""The cache explorer's data (issue 23): one JSON snapshot of the cache, taken on the engine
thread between two steps (so every figure in it is of one moment, and the counters in it are
the ones ``/metrics`` reports from the same kind of snapshot).

* ``blocks``: the pool as one character per block: ``f`` free, ``c`` cached (evictable, or held
  by the radix tree only), ``u`` in use holding computed KV, ``w`` allocated to a running
  request and not computed yet; ``loading``: blocks in flight from slower tiers;
* ``counters`` (cumulative; the page draws rates from successive polls): prefix-cache queries,
  hits, tier tokens and missed tokens by reason; ``tenants``: per-tenant figures, top-N + other;
* ``prefixes``: what is cached, as nodes ``{id, parent, start, tokens, blocks, hits,
  last_use_s, tenant}`` — the radix tree's nodes, or the hash chains' runs of blocks with one
  child each; the busiest ``max_nodes`` by recency. ``text`` (at most 64 tokens a node) only
  when the server runs with ``--dashboard-show-text``;
* ``tiers``: per storage tier, fill, hit tokens and load latency;
* ``auto_reuse`` (``--segment-reuse auto``, else null): answers from automatically reused KV and
  what the guard did, and the shadow audit's record (docs/ARCHITECTURE.md, "Automatic segment
  reuse"): audits, those over the bound, the measured drift's histogram, per tenant, and the
  namespaces whose reuse the breaker turned off — the figures ``/metrics`` reports.
"""

from __future__ import annotations

import time

from ..blend.shadow import KL_BUCKETS
from .metrics_cache import hit_rate, top_tenants

TEXT_TOKENS = 64


def block_map(engine) -> str:
    pool, mgr, bs = engine.pool, engine.cache, engine.pool.block_size
    state = ["c" if b.block_hash is not None or b.ref_cnt > 0 else "f" for b in pool.blocks]
    for seq in engine.scheduler.running:
        for i, bid in enumerate(mgr.block_table(seq.request_id)):
            if state[bid] != "u":
                state[bid] = "u" if i * bs < seq.num_computed_tokens else "w"
    for bid in pool.pinned:
        state[bid] = "u"
    return "".join(state)


def _owner(watch, hashes, now: float) -> tuple[str | None, float | None]:
    for h in hashes:
        entry = watch.owner.get(h) if h is not None else None
        if entry is not None:
            return entry[0], round(now - entry[1], 1)
    return None, None


def hash_prefixes(engine, show_text: bool, max_nodes: int) -> list[dict]:
    pool, watch, bs = engine.pool, engine.watch, engine.pool.block_size
    now, cached = time.time(), pool.cached
    kids = {p: [c for c in cs if c in cached] for p, cs in watch.children.items() if p in cached}
    roots = [h for h in cached if watch.parent_of.get(h) not in cached]
    nodes: list[dict] = []
    stack = [(h, None, 0) for h in roots]
    while stack and len(nodes) < 4 * max_nodes:
        h, parent, start = stack.pop()
        run = [h]
        while len(kids.get(run[-1], ())) == 1:
            run.append(kids[run[-1]][0])
        tenant, age = _owner(watch, run, now)
        node = {"id": len(nodes), "parent": parent, "start": start, "tokens": len(run) * bs, "blocks": len(run),
                "hits": max(cached[x].hits for x in run), "last_use_s": age, "tenant": tenant}
        if show_text:
            node["tokens_ids"] = [t for x in run for t in watch.tokens.get(x, ())][:TEXT_TOKENS]
        nodes.append(node)
        stack.extend((c, node["id"], start + len(run) * bs) for c in kids.get(run[-1], ()))
    return nodes


def radix_prefixes(engine, show_text: bool, max_nodes: int) -> list[dict]:
    tree, watch = engine.cache.tree, engine.watch
    now = time.time()
    nodes: list[dict] = []
    stack = [(child, None) for root in tree.roots.values() for child in root.children.values()]
    while stack and len(nodes) < 4 * max_nodes:
        n, parent = stack.pop()
        tenant, age = _owner(watch, [b.block_hash for b in n.blocks], now)
        node = {"id": len(nodes), "parent": parent, "start": n.start, "tokens": len(n.key), "blocks": len(n.blocks),
                "hits": n.hits, "last_use_s": age, "tenant": tenant}
        if show_text:
            node["tokens_ids"] = list(n.key[:TEXT_TOKENS])
        nodes.append(node)
        stack.extend((c, node["id"]) for c in n.children.values())
    return nodes


def _prune(nodes: list[dict], max_nodes: int) -> list[dict]:
    """Keep the most recently used ``max_nodes`` nodes and their ancestors."""
    if len(nodes) <= max_nodes:
        return nodes
    keep: set[int] = set()
    for n in sorted(nodes, key=lambda n: n["last_use_s"] if n["last_use_s"] is not None else 1e18):
        i = n["id"]
        while i is not None and i not in keep:
            keep.add(i)
            i = nodes[i]["parent"]
        if len(keep) >= max_nodes:
            break
    return [n for n in nodes if n["id"] in keep]


def tier_figures(stats) -> list[dict]:
    out = []
    for name, t in (stats.kv_tiers or {}).get("tiers", {}).items():
        count = sum(t.get("load_latency_buckets", [])) or 0
        out.append({"name": name, "medium": t.get("medium"), "state": t.get("state"),
                    "used_bytes": t.get("used_bytes") or 0, "capacity_bytes": t.get("capacity_bytes") or 0,
                    "hit_tokens": t.get("hit_tokens", 0), "lookups": t.get("queries", 0), "found": t.get("hits", 0),
                    "loads": count, "load_ms_mean": round(1e3 * t.get("load_latency_sum", 0.0) / count, 3) if count else None})
    return out


def auto_reuse_figures(engine, stats) -> dict | None:
    """Automatic reuse's counters and its audit's record (``EngineStats``), or None when the mode is off."""
    config = engine.config
    if config.segment_reuse != "auto":
        return None
    kl = stats.auto_reuse_audit_kl or {"buckets": list(KL_BUCKETS), "counts": [0] * (len(KL_BUCKETS) + 1), "sum": 0.0}
    return {"requests": stats.auto_reuse_requests, "tokens": stats.auto_reuse_tokens,
            "fallbacks": stats.auto_reuse_fallbacks, "repairs": stats.auto_reuse_repairs,
            "audits": stats.auto_reuse_audits, "over_bound": stats.auto_reuse_audits_over_bound,
            "failed": stats.auto_reuse_audits_failed, "audited_tokens": stats.auto_reuse_audited_tokens,
            "trips": stats.auto_reuse_audit_trips, "namespaces_off": stats.auto_reuse_namespaces_off,
            "kl": kl, "tenants": dict(stats.auto_reuse_audit_tenants or {}),
            "bound": engine.segment_reuse.audit_bound, "audit_rate": config.auto_reuse_audit_rate,
            "audit_tokens": config.auto_reuse_audit_tokens}


def cache_state(engine, show_text: bool = False, top_n: int = 10, max_nodes: int = 300) -> dict:
    """Runs on the engine thread (``AsyncEngine.call``): the stats snapshot and the cache's
    contents of one moment. ``engine`` is the :class:`~kvmosaic.engine.llm_engine.LLMEngine`."""
    stats = engine.get_stats()
    lens = stats.lens or {}
    tenants = top_tenants(lens.get("tenants", {}), top_n)
    prefixes: list[dict] = []
    if engine.watch is not None and engine.cache.enable_caching:
        build = radix_prefixes if hasattr(engine.cache, "tree") else hash_prefixes
        prefixes = _prune(build(engine, show_text, max_nodes), max_nodes)
        if show_text:
            for n in prefixes:
                n["text"] = engine.tokenizer.decode(n.pop("tokens_ids"))
    connector = engine.scheduler.connector
    loading = sum(len(keys) for keys, _ in connector._loading.values()) if connector is not None else 0
    return {
        "time": time.time(),
        "backend": engine.config.prefix_cache,
        "block_size": engine.pool.block_size,
        "blocks": block_map(engine),
        "loading": loading,
        "requests": {"running": stats.num_running, "waiting": stats.num_waiting,
                     "loading": len(engine.scheduler.loading)},
        "counters": {"queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits,
                     "tier_tokens": lens.get("tier_tokens", 0), "miss_tokens": lens.get("miss_tokens", {}),
                     "evictions": stats.num_evictions, "prompt_tokens": stats.prompt_tokens,
                     "generation_tokens": stats.generation_tokens},
        "kv": {"num_blocks": stats.num_blocks, "num_free_blocks": stats.num_free_blocks,
               "num_cached_blocks": stats.num_cached_blocks, "usage": stats.kv_cache_usage},
        "tenants": [{"tenant": t, **f, "hit_rate": hit_rate(f)} for t, f in tenants.items()],
        "prefixes": prefixes,
        "show_text": show_text,
        "tiers": tier_figures(stats),
        "auto_reuse": auto_reuse_figures(engine, stats),
    }
