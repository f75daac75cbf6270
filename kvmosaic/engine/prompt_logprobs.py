"""Prompt log-probabilities (vLLM's ``prompt_logprobs``; the completions API's ``echo`` with
``logprobs``): for every prompt token but the first, the log-probability the model gave it at the
position before, with the top-k there (the raw distribution, as for generated tokens).

They need the head over every prompt position, so a request that asks for them reads nothing from
the cache (``Sequence.reads_cache``: not the pool, the tiers or segment reuse; vLLM's rule, since a
cached position has no hidden state here) and counts as no cache query — unless the scored prefix
cache keeps the hidden rows of its prefix (engine/scored_prefix.py, off by default). Its blocks are stored as
any prompt's are, for the requests after it. The runner takes the last layer's hidden states at
those rows (``LlamaForCausalLM.forward``'s ``hidden_index``) and runs the head over ``SLICE`` rows
at a time, so a 2,048-token chunk holds ``SLICE`` x vocabulary logits at once, not 2,048."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheduler import ScheduledSeq
from .sequence import Sequence

SLICE = 64


@dataclass
class PromptRows:
    """The rows of a step's flat batch whose logits score a prompt token."""

    index: torch.Tensor  # [R] int64, ascending
    targets: list[int]  # the prompt token each row's logits score (the next position's)
    ks: list[int]  # each row's top-k
    spans: list[tuple[Sequence, int, int]]  # (sequence, first position, rows), in row order


def prompt_rows(batch: list[tuple[ScheduledSeq, list]]) -> PromptRows | None:
    """The rows of ``batch`` (packed in its order, ``num_new_tokens`` each, as the runner packs it)
    at positions ``0 .. num_prompt_tokens - 2`` of sequences asking for prompt log-probabilities;
    None when there are none."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    spans = []
    t = 0
    for s, _ in batch:
        seq, k = s.seq, s.seq.params.prompt_logprobs
        start = seq.num_computed_tokens
        end = start if k is None else min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        if end > start:
            rows.extend(range(t, t + end - start))
            targets.extend(seq.prompt_token_ids[start + 1 : end + 1])
            ks.extend([k] * (end - start))
            spans.append((seq, start, end - start))
        t += s.num_new_tokens
    return PromptRows(torch.tensor(rows, dtype=torch.long), targets, ks, spans) if rows else None


Scored = list[tuple[Sequence, int, list[dict[int, float]], list[int]]]


def score(model, hidden: torch.Tensor, rows: PromptRows) -> Scored:
    """Each span's entries from the hidden states at ``rows.index`` (pre-norm, ``[R, hidden]``):
    ``(sequence, first position, [{token: log-probability}], [rank of the prompt's token])``, one
    entry a position; rank 1 is the most likely token."""
    entries: list[dict[int, float]] = []
    ranks: list[int] = []
    for i in range(0, len(rows.targets), SLICE):
        lp = log_probs(model.compute_logits(hidden[i : i + SLICE]).cpu())
        targets = torch.tensor(rows.targets[i : i + SLICE])
        own = lp.gather(1, targets[:, None])
        ranks += ((lp > own).sum(1) + 1).tolist()
        ks = rows.ks[i : i + SLICE]
        top_vals, top_ids = lp.topk(max(ks), dim=-1)
        for t, o, ids, vals, kr in zip(targets.tolist(), own[:, 0].tolist(), top_ids.tolist(), top_vals.tolist(), ks):
            entry = dict(zip(ids[:kr], vals[:kr]))
            entry[t] = o
            entries.append(entry)
    out, at = [], 0
    for seq, start, n in rows.spans:
        out.append((seq, start, entries[at : at + n], ranks[at : at + n]))
        at += n
    return out


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of float32 logits rows, as ``sampler.top_logprobs`` takes them (JSON has no
    NaN or infinity: an impossible token gets vLLM's -9999.0)."""
    lp = torch.log_softmax(logits, dim=-1)
    if bool(torch.isfinite(lp).all()):
        return lp
    lp = torch.log_softmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
    return torch.nan_to_num(lp, nan=-9999.0, posinf=0.0, neginf=-9999.0)


def record(scored: Scored) -> None:
    """Append a step's entries to each sequence's ``prompt_logprobs`` and ``prompt_ranks`` (a
    prompt computed again from its start, after a preemption, starts its lists again)."""
    for seq, start, entries, ranks in scored:
        if start == 0 or seq.prompt_logprobs is None:
            seq.prompt_logprobs, seq.prompt_ranks = [None], [None]
        del seq.prompt_logprobs[start + 1 :], seq.prompt_ranks[start + 1 :]
        seq.prompt_logprobs.extend(entries)
        seq.prompt_ranks.extend(ranks)
