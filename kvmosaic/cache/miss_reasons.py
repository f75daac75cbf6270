"""Why each prompt token was not served from the cache (issue 23): one reason per missed token.

For a request admitted with ``served`` leading tokens from the cache (pool hit + storage-tier
load) out of ``L`` prompt tokens, the ``L - served`` missed tokens are split, position by
position, into exactly one of:

* ``partial_block``: in the prompt's last block, which no full-block hit can serve: the tail
  below one block, or the block holding the last prompt token (always recomputed: its logits
  are needed); radix serves part of it. Also a partial block the radix backend declined to copy;
* ``tier_miss``: a storage tier held the block but its load failed, was late or was corrupt;
* ``evicted``: the block (this namespace, this history) was cached and was evicted (it is a
  recent ghost, or still cached but behind an evicted block), and no tier served it;
* ``namespace`` (admin views only): the same tokens with the same history are cached under
  another namespace (another tenant's salt, or another adapter);
* ``diverged``: from the break on, when something cached in this namespace shares the prompt
  up to the break and continues differently (a sibling block in the hash chain; in the radix
  tree, an edge or a child going on with another token);
* ``cold``: never cached: what is left (the prompt extends past everything cached, or shares
  nothing with it).

Invariant (tested on mixed workloads, both backends): the counts of each view sum to
``L - served`` exactly. The *tenant* view never consults another namespace: it has no
``namespace`` reason (those tokens read as the break's ``diverged``/``cold``), and where a hash chain's
break follows a shared-public block, whose children may be other tenants' blocks,
divergence is not reported (the radix tree keeps one root per namespace, so it never
mixes). So what a tenant sees depends only on its own namespace's history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .watch import ROOT_KEY, CacheWatch, plain_key

REASONS = ("cold", "evicted", "tier_miss", "partial_block", "diverged", "namespace")
TENANT_REASONS = tuple(r for r in REASONS if r != "namespace")


@dataclass
class MissBreakdown:
    """Missed tokens by reason: ``tenant`` (safe to show the caller) and ``admin`` views."""

    tenant: dict[str, int] = field(default_factory=dict)
    admin: dict[str, int] = field(default_factory=dict)
    break_token: int | None = None  # where the served prefix stops (None: nothing missed)
    runs: list[tuple[int, int, str, str]] = field(default_factory=list)  # (start, end, tenant, admin), in order

    def add(self, tenant_reason: str, admin_reason: str, n: int, start: int) -> None:
        if n > 0:
            self.runs.append((start, start + n, tenant_reason, admin_reason))
            self.tenant[tenant_reason] = self.tenant.get(tenant_reason, 0) + n
            self.admin[admin_reason] = self.admin.get(admin_reason, 0) + n


def radix_diverges(tree, namespace, tokens: Sequence[int]) -> tuple[int, bool]:
    """How far the radix tree of ``namespace`` matches ``tokens``, and whether it goes on
    there with another token (mid-edge, or a child starting differently): a divergence."""
    tm = tree.match(namespace, tokens)
    node, reach = tm.node, tm.num_tokens
    if node is None or reach >= len(tokens):
        return reach, False
    return reach, reach > 0 and (reach < node.end or bool(node.children))


def classify(mgr, watch: CacheWatch, req, hashes: Sequence[bytes], served: int,
             tier_attempted: int = 0, pool_tokens: int | None = None) -> MissBreakdown:
    """Split ``req``'s missed prompt tokens (``served`` onward) by reason.

    ``mgr``: the request's cache manager (radix: its tree answers divergence); ``hashes``: the
    request's chain hashes (at least its full blocks); ``tier_attempted``: tokens the tiers
    were asked for past the pool's hit (``len(match.tier_hits) * block_size``);
    ``pool_tokens``: the pool's hit (default ``served``)."""
    tokens = req.all_token_ids
    L, bs = len(tokens), mgr.block_size
    out = MissBreakdown()
    if served >= L:
        return out
    out.break_token = served
    full_end = (L - 1) // bs * bs  # positions below it lie in blocks a full-block hit may serve
    pool_tokens = served if pool_tokens is None else pool_tokens
    tier_fail_end = (pool_tokens // bs * bs + tier_attempted) if tier_attempted else 0
    if served < full_end:
        ns = mgr.request_namespace(req)
        tree = getattr(mgr, "tree", None)
        brk = served // bs
        if tree is not None:
            reach, diverged = radix_diverges(tree, ns, tokens[:full_end])
            if served < reach and served % bs:  # a partial block the backend declined to copy
                out.add("partial_block", "partial_block", min(reach, (brk + 1) * bs) - served, served)
                served = min(reach, (brk + 1) * bs)
            public_edge = False  # the request's own root: no other tenant's path is in it
        else:
            diverged = brk > 0 and brk < len(hashes) and watch.has_sibling(hashes[brk - 1], hashes[brk])
            public_edge = bool(ns.public_blocks) and brk <= ns.public_blocks  # public parents: anyone's children
        base = "diverged" if diverged else "cold"
        tenant_base = "cold" if public_edge else base
        plain = ROOT_KEY
        for j in range(full_end // bs):
            if j * bs + bs <= served:
                plain = plain_key(plain, tokens[j * bs : j * bs + bs])
                continue
            lo, hi = max(served, j * bs), j * bs + bs
            h = hashes[j] if j < len(hashes) else None
            plain = plain_key(plain, tokens[j * bs : hi])
            if hi <= tier_fail_end:
                out.add("tier_miss", "tier_miss", hi - lo, lo)
            elif h is not None and (h in watch.ghosts or h in watch.parent_of):
                out.add("evicted", "evicted", hi - lo, lo)
            elif watch.plain_count.get(plain):
                out.add(tenant_base, "namespace", hi - lo, lo)
            else:
                out.add(tenant_base, base, hi - lo, lo)
        served = full_end
    out.add("partial_block", "partial_block", L - served, served)
    return out
