"""The per-request quality guard of automatic reuse (issue 24, item 3).

Reused KV is approximate. Before a request is answered from it, the guard reads the drift
estimate that the blend pass computed anyway (:attr:`BlendResult.drift`: the mean check-layer
deviation score of the reused tokens that were kept, i.e. how far their KV is from what this
context gives them, after repair) and, when it exceeds the bound, computes the uncertain part
again in full: every position from the first kept reused token (``exact_until``) on, attending
to the exact KV before it. That is exactly a prefill of those positions, so a request that
fell back is answered as a full prefill would answer it (tested: ``tests/test_auto_reuse.py``).

Invariant: a request answered from reused KV has ``drift <= bound``; one that was not has
``fell_back`` set and no reused token left in its KV (``exact_until == len(prompt)``).
The estimate costs nothing extra; the fallback costs a prefill of the uncertain part.
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
