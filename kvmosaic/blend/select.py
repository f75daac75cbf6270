"""Which reused tokens to recompute: scored by how far their reused KV is from fresh KV.

The score of a token is the relative L2 deviation of its K and V at one early layer,
``||[k - k', v - v']|| / ||[k, v]||`` (k, v fresh; k', v' reused), summed over KV heads. Layer
0's KV depends on the token alone, so layer 1 is the earliest whose KV sees the context at all;
layer 2 (two rounds of attention) is the default: on the rag-reorder benchmark it halves the
mean KL of layer 1 at r=15% and 30% for 1/30 more of a prefill (BENCHMARKS.md).
"""

from __future__ import annotations

import math

import torch


def deviation(k: torch.Tensor, v: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Per-token relative deviation; inputs ``[T, kv_heads, head_dim]``, output ``[T]``."""
    fresh = torch.cat((k, v), dim=-1).float().flatten(1)
    old = torch.cat((k_old, v_old), dim=-1).float().flatten(1)
    return (fresh - old).norm(dim=-1) / fresh.norm(dim=-1).clamp_min(1e-12)


def choose(
    scores: torch.Tensor,
    ratio: float | None = None,
    threshold: float | None = None,
    random: bool = False,
    generator: torch.Generator | None = None,
    floor: float = 0.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices (sorted) of the tokens to recompute.

    ``threshold`` (when set) takes every token whose score exceeds it; otherwise ``ratio``
    takes the ``ceil(ratio * n)`` highest, but none whose score is ``floor`` or less (their KV
    is already as this context gives it: auto reuse at the same position, blend/auto.py).
    With ``weights`` the ratio ranks ``scores * weights`` (:func:`attention_weights`); the
    threshold and the floor still read the scores. ``random`` picks the same number uniformly
    instead (the baseline that shows what the scores are worth).
    """
    n = scores.numel()
    if threshold is not None:
        count = int((scores > threshold).sum())
    else:
        count = min(n, math.ceil((ratio or 0.0) * n - 1e-9))
        if floor > 0:
            count = min(count, int((scores > floor).sum()))
    if count == 0:
        return torch.empty(0, dtype=torch.long)
    if random:
        idx = torch.randperm(n, generator=generator)[:count]
    else:
        plain = scores.float().cpu()
        ranked = plain if weights is None else plain * weights.float().cpu()
        if floor > 0 and weights is not None:
            ranked[plain <= floor] = -1.0  # never above a token past the floor
        idx = torch.topk(ranked, count).indices
    return idx.sort().values


def within_mean(scores: torch.Tensor, chosen: torch.Tensor, max_mean: float) -> torch.Tensor:
    """The fewest further indices (highest scores first, whatever the floor) whose choice leaves the
    tokens not chosen with a mean score of at most ``max_mean`` (none left: mean 0): the auto-reuse
    guard's repair (blend/guard.py)."""
    left = torch.ones(scores.numel(), dtype=torch.bool)
    left[chosen] = False
    order = torch.nonzero(left).squeeze(1)
    order = order[torch.argsort(scores[order], descending=True, stable=True)]
    # remaining[j]: the mean of what is left after taking the first j of ``order``, in float64
    ranked = scores[order].double()
    total, m = ranked.sum(), ranked.numel()
    taken = torch.cat((torch.zeros(1, dtype=torch.float64), ranked.cumsum(0)))
    count = torch.arange(m, -1, -1, dtype=torch.float64).clamp_min(1)
    remaining = (total - taken) / count
    remaining[m] = 0.0
    j = int(torch.nonzero(remaining <= max_mean)[0])
    # the mean the caller reports (BlendResult.drift: float64, in position order) must agree
    while j < m and float(scores[order[j:].sort().values].double().mean()) > max_mean:
        j += 1
    return order[:j]


def attention_weights(attention: torch.Tensor) -> torch.Tensor:
    """Ranking weights from one query's attention over ``n`` tokens: ``1 + n * a``, so a token
    read as much as the average one counts twice, one never read counts its deviation alone."""
    return 1.0 + attention.numel() * attention.float()
