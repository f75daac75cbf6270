"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the smallest set whose
    probability reaches top_p. ``logits`` is one row, already divided by temperature."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` ``[n, vocab]`` (float32)."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
            continue
        row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out


def top_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int | None]) -> list[dict[int, float] | None]:
    """vLLM's ``logprobs``: the top-k log-probabilities of the raw distribution, plus the
    chosen token's."""
    if not any(k is not None for k in ks):
        return [None] * len(ks)
    lp = torch.log_softmax(logits, dim=-1)
    out: list[dict[int, float] | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        d = {}
        if k:
            vals, idx = torch.topk(lp[i], k)
            d = dict(zip(idx.tolist(), vals.tolist()))
        d[token_ids[i]] = float(lp[i, token_ids[i]])
        out.append(d)
    return out
