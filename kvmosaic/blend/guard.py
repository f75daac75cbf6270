"""The per-request quality guard of automatic reuse (issue 24, item 3).

Reused KV is approximate. The drift estimate is what the blend pass computes anyway
(:attr:`BlendResult.drift`: the check-layer deviation scores of the reused tokens kept, i.e. how far
their KV is from what this context gives them, averaged over at most ``select.DRIFT_SPAN`` of them:
the mean for a few documents, growing with what is kept past that, as the measured drift does).
The bound acts twice:

1. **Repair, in the blend pass**: with ``BlendOptions.max_drift`` set (auto reuse sets it to the
   bound), the selection recomputes, beyond the ratio, the most deviating reused tokens, as few as
   bring the estimate of those kept within the bound (``select.within_drift``): the uncertain part
   is computed in full and the rest stays reused. A request that a bound-free blend would have
   answered above the bound costs a few more recomputed tokens, not a second prefill.
2. **Fallback, here**: a result still above the bound (a blend without scores or without the
   bound) is computed again in full from the first kept reused token (``exact_until``) on,
   attending to the exact KV before it: exactly a prefill of those positions, so it answers as a
   full prefill would (tested: ``tests/test_auto_reuse.py``).

Invariant: a request answered from reused KV has ``drift <= bound``; one that was not has
``fell_back`` set and no reused token left in its KV (``exact_until == len(prompt)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.paged import PagedKVCache
from ..model.llama import LlamaForCausalLM
from .blender import BlendResult
from .forward import blend_forward


@dataclass(frozen=True)
class GuardVerdict:
    logits: torch.Tensor  # the logits to answer from
    drift: float  # the estimate (before any fallback)
    fell_back: bool
    exact_until: int  # after the verdict: KV below this equals a full prefill's
    num_reused_tokens: int  # reused tokens kept in the KV that answers (0 after a fallback)


def guard(model: LlamaForCausalLM, kv: PagedKVCache, token_ids: list[int], slots: torch.Tensor,
          res: BlendResult, bound: float, logits_positions: list[int]) -> GuardVerdict:
    """Accept ``res`` or recompute from ``res.exact_until`` on (see the module docstring)."""
    n = len(token_ids)
    if res.num_segment_tokens == 0 or res.drift <= bound:
        return GuardVerdict(res.logits, res.drift, False, res.exact_until, res.num_segment_tokens)
    ids = torch.tensor(token_ids, dtype=torch.long)
    out = blend_forward(model, kv, ids, slots, res.exact_until, torch.zeros(n, dtype=torch.bool),
                        torch.tensor(logits_positions), None)
    return GuardVerdict(out.logits, res.drift, True, n, 0)
