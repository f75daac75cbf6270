"""Logits processors: penalties, ``logit_bias``, ``allowed_token_ids`` and ``min_tokens``, batched
over the rows.

vLLM's semantics (see :class:`~.sampling_params.SamplingParams`). Invariants:

* rows whose parameters are all at their defaults are untouched, and when no row has work the
  input tensor itself is returned (greedy outputs with default parameters are unchanged);
* the work is tensor operations over the rows that need it (scatter of token counts, one
  masked update per processor); no Python loop runs over the vocabulary, and the Python loops
  over rows only gather each row's token ids and bias entries;
* a token id past the vocabulary (a ``stop_token_ids`` entry the caller did not check) is
  ignored, never an index error.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from .sampling_params import SamplingParams


class Row(Protocol):
    """What a processor reads from one request (the engine's ``Sequence`` provides it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` occurrence counts of each row's ids (ids past the vocabulary dropped)."""
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    width = max((len(x) for x in ids), default=0)
    if width:
        index = torch.full((len(ids), width), vocab, dtype=torch.long)
        for i, x in enumerate(ids):
            if x:
                index[i, :len(x)] = torch.tensor(x, dtype=torch.long).clamp_(0, vocab)
        counts.scatter_add_(1, index.to(device), torch.ones(index.shape, device=device))
    return counts[:, :vocab]


def apply_logits_processors(logits: torch.Tensor, rows: Seq[Row], eos_ids: Iterable[int]) -> torch.Tensor:
    """``logits`` ``[len(rows), vocab]`` with each row's penalties, bias and ``min_tokens``
    applied (a new tensor), or ``logits`` itself when no row asks for any. ``eos_ids``: every id
    that ends a generation (the model's stop tokens), banned before ``min_tokens``."""
    todo = [i for i, r in enumerate(rows) if r.params.processes_logits]
    if not todo:
        return logits
    vocab, device = logits.shape[-1], logits.device
    sub = logits[todo].clone()
    params = [rows[i].params for i in todo]
    outs = [rows[i].output_token_ids for i in todo]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
        out_counts = _counts(outs, vocab, device)
        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):  # over prompt and output, as vLLM
            seen = (_counts([rows[i].prompt_token_ids for i in todo], vocab, device) + out_counts) > 0
            r = column(rep).expand_as(sub)
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        sub = sub - column([p.frequency_penalty for p in params]) * out_counts
        sub = sub - column([p.presence_penalty for p in params]) * (out_counts > 0).to(sub.dtype)
    bias_rows, bias_cols, bias_vals = [], [], []
    for j, p in enumerate(params):
        for tok, b in (p.logit_bias or {}).items():
            if tok < vocab:
                bias_rows.append(j), bias_cols.append(tok), bias_vals.append(b)
    if bias_rows:
        sub.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
                       torch.tensor(bias_vals, dtype=sub.dtype, device=device), accumulate=True)
    ban_rows, ban_cols = [], []
    for j, p in enumerate(params):
        if len(outs[j]) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            ban = [t for t in stops if 0 <= t < vocab]
            ban_rows += [j] * len(ban)
            ban_cols += ban
    if ban_rows:
        sub[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = float("-inf")
    for j, p in enumerate(params):  # vLLM's allowed_token_ids: every other token impossible
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=device)
            sub[j] = torch.full_like(sub[j], float("-inf")).index_copy_(0, keep, sub[j, keep])
    out = logits.clone()
    out[todo] = sub
    return out


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """One row (after temperature): tokens less likely than ``min_p`` times the most likely
    one become impossible; ``min_p == 0`` returns the row unchanged."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
