"""``kvmosaic explain`` against the live cache: block by block, where a prompt would hit, from
which tier, and why it would stop (issue 23, the dashboard's explain box).

Invariant: a probe changes nothing — not the pool (no reference, no LRU touch, no hit count),
not the manager (no per-request hasher, no lock), not the tiers (presence is read from a
tier's index without counting a lookup; a tier with no such index, Redis, is not probed), not
the counters. It runs on the engine thread, between two steps, like any read of the cache.
Reasons are the admin view of :mod:`.miss_reasons`, computed as if every tier load succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .manager import KVCacheManager, PlainRequest
from .miss_reasons import classify
from .watch import CacheWatch


def peek_tiers(stack, keys: Sequence[bytes]) -> list[int | None]:
    """The fastest tier holding each key, None from the first key none holds; reads each tier's
    own index (``_lru``) so no lookup is counted; tiers without one are skipped."""
    found: list[int | None] = [None] * len(keys)
    for i, tier in enumerate(stack or ()):
        index = getattr(tier, "_lru", None)
        if index is None:
            continue
        for j, hit in enumerate(index.contains_many(list(keys))):
            if hit and found[j] is None:
                found[j] = i
    if None in found:
        first = found.index(None)
        found[first:] = [None] * (len(found) - first)
    return found


def _pool_hit(mgr: KVCacheManager, req: PlainRequest, hashes: Sequence[bytes]) -> tuple[int, list]:
    """Tokens the pool would serve and the blocks holding them (read-only lookups)."""
    tokens, bs = req.all_token_ids, mgr.block_size
    tree = getattr(mgr, "tree", None)
    if tree is not None:
        tm = tree.match(mgr.request_namespace(req), tokens[: len(tokens) - 1])
        return tm.num_tokens, list(tm.blocks)
    if not mgr.enable_caching:
        return 0, []
    blocks = []
    for h in hashes[: (len(tokens) - 1) // bs]:
        block = mgr.pool.cached.get(h)
        if block is None:
            break
        blocks.append(block)
    return len(blocks) * bs, blocks


def probe(mgr: KVCacheManager, watch: CacheWatch, tokens: Sequence[int], cache_salt: str | None = None,
          adapter_id: str | None = None, stack=None, decode=None) -> dict:
    """Per block of ``tokens``: ``where`` ("pool", a tier's name, or "computed"), the pool
    block's hits and age, and for missed tokens the reason; plus the totals and the stop."""
    req = PlainRequest("probe", list(tokens), cache_salt, adapter_id)
    bs, L = mgr.block_size, len(tokens)
    hashes = mgr.new_hasher(cache_salt, adapter_id).update(list(tokens))
    pool_tokens, blocks = _pool_hit(mgr, req, hashes)
    first_tier = pool_tokens // bs
    limit = (L - 1) // bs
    tiers = peek_tiers(stack, hashes[first_tier:limit]) if stack is not None and first_tier < limit else []
    tier_blocks = tiers.index(None) if None in tiers else len(tiers)
    if tier_blocks:
        pool_tokens -= pool_tokens % bs  # a tier block replaces a partial pool match
    served = pool_tokens + tier_blocks * bs
    out = classify(mgr, watch, req, hashes, served, 0, pool_tokens)
    now = time.time()
    rows = []
    for i in range(-(-L // bs)):
        lo, hi = i * bs, min(L, i * bs + bs)
        row: dict = {"block": i, "start": lo, "end": hi, "hit_tokens": max(0, min(hi, served) - lo)}
        if lo < pool_tokens:
            b = blocks[i] if i < len(blocks) else None
            row["where"] = "pool"
            if b is not None:
                row["block_id"], row["hits"] = b.block_id, b.hits
            h = hashes[i] if i < len(hashes) else None
            owner = watch.owner.get(h) if h is not None else None
            if owner is not None:
                row["tenant"], row["last_use_s"] = owner[0], round(now - owner[1], 1)
        elif lo < served:
            row["where"] = stack[tiers[i - first_tier]].name
        else:
            row["where"] = "computed"
        row["reasons"] = {r[3]: min(hi, r[1]) - max(lo, r[0]) for r in out.runs if r[0] < hi and r[1] > lo}
        if decode is not None:
            row["text"] = decode(list(tokens[lo:hi]))
        rows.append(row)
    stop = None
    if out.runs:
        start, _, _, reason = out.runs[0]
        stop = {"token": start, "block": start // bs, "reason": reason}
    return {"num_tokens": L, "block_size": bs, "pool_tokens": pool_tokens, "tier_tokens": served - pool_tokens,
            "missed": dict(out.admin), "stop": stop, "blocks": rows}
