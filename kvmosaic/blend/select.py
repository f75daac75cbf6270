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


# The guard's estimate (drift_estimate) averages the kept tokens' deviations over at most this many
# tokens and adds them up past it: documents four times longer kept four times the tokens at a lower
# mean deviation and drifted 2-3x further (KL to full prefill, benchmarks/auto_reuse.py); prompts that
# keep fewer tokens see the plain mean. BENCHMARKS.md, issue 24.
DRIFT_SPAN = 512


def drift_estimate(kept: torch.Tensor, span: int = DRIFT_SPAN) -> float:
    """The auto-reuse guard's drift estimate from the check-layer deviations of the reused tokens
    kept (in position order): their sum over ``min(len(kept), span)`` in float64, so the mean for up
    to ``span`` tokens and the sum / ``span`` past it; 0.0 for none."""
    n = kept.numel()
    return float(kept.double().sum() / min(n, span)) if n else 0.0


def within_drift(scores: torch.Tensor, chosen: torch.Tensor, bound: float, span: int = DRIFT_SPAN) -> torch.Tensor:
    """The fewest further indices (highest scores first, whatever the floor) whose choice leaves the
    tokens not chosen with a :func:`drift_estimate` of at most ``bound``: the auto-reuse guard's
    repair (blend/guard.py). Taking the highest score left never raises the estimate."""
    left = torch.ones(scores.numel(), dtype=torch.bool)
    left[chosen] = False
    order = torch.nonzero(left).squeeze(1)
    order = order[torch.argsort(scores[order], descending=True, stable=True)]
    # remaining[j]: the estimate of what is left after taking the first j of ``order``, in float64
    ranked = scores[order].double()
    total, m = ranked.sum(), ranked.numel()
    taken = torch.cat((torch.zeros(1, dtype=torch.float64), ranked.cumsum(0)))
    count = torch.arange(m, -1, -1, dtype=torch.float64).clamp(1, span)
    remaining = (total - taken) / count
    remaining[m] = 0.0
    j = int(torch.nonzero(remaining <= bound)[0])
    # the estimate the caller reports (BlendResult.drift: in position order) must agree
    while j < m and drift_estimate(scores[order[j:].sort().values], span) > bound:
        j += 1
    return order[:j]


def attention_weights(attention: torch.Tensor) -> torch.Tensor:
    """Ranking weights from one query's attention over ``n`` tokens: ``1 + n * a``, so a token
    read as much as the average one counts twice, one never read counts its deviation alone."""
    return 1.0 + attention.numel() * attention.float()
