"""Scored prompts that share a prefix compute it once (``--scored-prefix-cache-memory``; off by default).

A request asking for prompt log-probabilities needs the head over every prompt position, and a
cached block holds only K and V: so it reads no cache (``Sequence.reads_cache``, vLLM's rule) and an
evaluation that scores several continuations of one context (lm-evaluation-harness's
log-likelihood requests) computes the context once per continuation. This store keeps, for the
full blocks a scored prompt computed, their positions' last-layer hidden states (before the final
norm, ``[block_size, hidden]``: ~1/20 of the block's KV for the shipped model), content-addressed
by the block's chain hash — which covers the whole history and the namespace, so a tenant never
reads another's rows (invariant 3). A later scoring request then starts after the longest cached
prefix whose every block has its rows here: the pool's KV for the layers, these rows for the head.

Invariant: the scores are those of the prompt computed whole — each position's entry comes from the
same hidden state, through the same head (tests/test_scored_prefix.py; bit for bit where the CPU's
GEMMs give a row the same result at any row count). Hash backend only (the radix tree and the hybrid
layout keep reading nothing for a scored prompt). LRU within ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..cache.block import KVBlock
from ..cache.manager import KVCacheManager, MatchResult
from .prompt_logprobs import PromptRows, Scored, score
from .scheduler import ScheduledSeq
from .sequence import Sequence


class ScoredPrefixCache:
    def __init__(self, manager: KVCacheManager, max_bytes: int) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # chain hash -> [block_size, hidden]
        self.hit_tokens = 0  # prompt tokens scored from here instead of computed

    def match(self, seq: Sequence) -> MatchResult:
        """The pool's prefix hit for ``seq``, cut to its leading blocks whose rows are here."""
        hit = self.manager.match_prefix(seq)
        n = 0
        while n < len(hit.blocks) and hit.blocks[n].block_hash in self.rows:
            n += 1
        return MatchResult(hit.blocks[:n], n * self.block_size)

    def prefix_rows(self, blocks: list[KVBlock]) -> torch.Tensor:
        """The hidden rows of ``blocks`` (a :meth:`match`), in order; they become the most recent."""
        for b in blocks:
            self.rows.move_to_end(b.block_hash)
        self.hit_tokens += len(blocks) * self.block_size
        return torch.cat([self.rows[b.block_hash] for b in blocks])

    def keep(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """``hidden``: the rows of positions ``start, start + 1, ...`` of ``seq``'s prompt, as a step
        computed them; each full block wholly among them is kept."""
        bs, end = self.block_size, start + hidden.shape[0]
        first, last = -(-start // bs), end // bs
        if first >= last:
            return
        hashes = self.manager.hasher(seq).update(seq.prompt_token_ids)
        for i in range(first, min(last, len(hashes))):
            rows = hidden[i * bs - start : (i + 1) * bs - start]
            if hashes[i] not in self.rows:
                self.rows[hashes[i]] = rows.detach().clone()
                self.bytes += rows.numel() * rows.element_size()
            self.rows.move_to_end(hashes[i])
        while self.bytes > self.max_bytes and self.rows:
            _, old = self.rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def keep_step(self, rows: PromptRows, hidden: torch.Tensor) -> None:
        """A step's scored rows (``prompt_rows``) and their hidden states, as the model gave them."""
        at = 0
        for seq, start, n in rows.spans:
            self.keep(seq, start, hidden[at : at + n])
            at += n


def score_prefixes(model, batch: list[tuple[ScheduledSeq, list]]) -> Scored:
    """The entries of the prefixes the step's scored prompts were admitted after (their kept
    rows, ``Sequence.prefix_hidden``, taken): positions ``1 .. len(rows)``."""
    out: Scored = []
    for s, _ in batch:
        seq = s.seq
        if seq.prefix_hidden is None:
            continue
        hidden, seq.prefix_hidden = seq.prefix_hidden, None
        n = hidden.shape[0]
        rows = PromptRows(torch.arange(n), seq.prompt_token_ids[1 : n + 1], [seq.params.prompt_logprobs] * n,
                          [(seq, 0, n)])
        out += score(model, hidden.to(model.output_weight.device), rows)
    return out
