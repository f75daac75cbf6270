"""Attention over the paged KV pool.

A step's tokens are packed into one flat batch (so every linear layer is one GEMM). The
runner describes how they split into sequences with :class:`AttentionMetadata`:

* ``slot_mapping[t]``: where token t's K/V is written;
* ``prefills``: sequences with more than one new token, each attended on its own (their
  queries are long, so per-sequence calls are efficient and need no padding);
* ``decode``: sequences with exactly one new token, attended together in one padded call.

Each sequence's context (cached tokens plus the new ones) is read from the pool through its
slots, so a cached prefix and freshly written KV are read the same way: in place by the C
kernels where they serve (bfloat16 causal prefill: ``kernels/prefill.py``; decode:
``kernels.paged_decode_attention``), else gathered into a copy for torch's attention.

Decodes that share a cached prefix (the same pool blocks at the head of their block tables,
e.g. one system prompt hit by every request) use cascade attention, as vLLM and FlashInfer
call it: the prefix's K/V is gathered once and attended by all their queries in one matrix
product, each sequence's own tail separately, and the two softmaxes are merged through their
log-sum-exps. It is the same attention (outputs within 1e-6 of the plain path in float32, tested
in ``tests/test_attention.py``); it saves reading the prefix once per sequence, which is most
of a batched decode step's attention time on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from . import kernels
from .kernels import prefill


class PagedKV(Protocol):
    """What attention needs of the KV pool (``kv.paged.PagedKVCache`` provides it): per-layer
    flat views ``[num_slots, kv_heads, head_dim]`` and a write by slot. model and kv sit side
    by side in the layers, so the model names this shape instead of importing kv."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


@dataclass
class PrefillSpan:
    """One prompt's new tokens in a step. A causal span (the new tokens are the context's last,
    each sees the keys up to itself) has ``mask`` None whatever its cached past: the prefill kernel
    computes exactly that, and torch's path, where the kernel does not serve, builds its explicit
    mask itself (:attr:`torch_mask`). Whether the past came from the cache must not change which
    code computes a row: with the kernel, a row is the same bits either way."""

    start: int  # first of this sequence's tokens in the flat batch
    end: int
    ctx_slots: torch.Tensor  # [ctx_len] slots of the whole context, new tokens last
    # [q_len, ctx_len] bool; None: causal, the span's tokens being the context's last ones
    mask: torch.Tensor | None
    # [q_len] int64: each query's position in the context, where the mask says exactly "keys up
    # to it" (a blend's recomputed tokens): the prefill kernel serves it without the mask
    positions: torch.Tensor | None = None

    @functools.cached_property
    def torch_mask(self) -> torch.Tensor | None:
        """The mask for torch's attention: ``mask``, or for a causal span the explicit mask where
        that is the cheaper way (:func:`prefill_mask`); built once, shared by every layer."""
        if self.mask is not None:
            return self.mask
        mask = prefill_mask(self.end - self.start, self.ctx_slots.numel())
        return None if mask is None else mask.to(self.ctx_slots.device)


@dataclass
class SharedPrefix:
    """Decode sequences (``members``, rows of the decode batch) whose contexts all begin with
    the KV at ``slots``: attended once for all of them (cascade attention)."""

    slots: torch.Tensor  # [prefix_len]
    members: torch.Tensor  # [n >= 2]


@dataclass
class DecodeBatch:
    token_index: torch.Tensor  # [B] position of each decode token in the flat batch
    # [B, max_ctx] padded with slot 0: each sequence's context, or, for a member of a shared
    # prefix, the part after it (never empty: the decode token itself is there)
    ctx_slots: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool, None when no padding
    shared: list[SharedPrefix] = field(default_factory=list)
    lens: torch.Tensor | None = None  # [B] int64: how many of each row's ctx_slots are real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode: DecodeBatch | None = None

    def select_queries(self, rows: torch.Tensor) -> AttentionMetadata | None:
        """This step's attention for the flat batch's ``rows`` alone (ascending, distinct), as the
        queries of a batch of those rows: each query keeps its keys and its position, so its result
        is the same bits. A span's rows that are its context's last stay a causal span; others get
        their positions (and a mask for torch's path). None where a decode row is not among
        ``rows`` (the caller then runs every row): decodes are attended as one batch."""
        d = self.decode
        rows_here = rows.to(self.slot_mapping.device)
        if d is not None:
            index = torch.searchsorted(rows_here, d.token_index)
            if int(index.max()) >= rows.numel() or not torch.equal(rows_here[index], d.token_index):
                return None
            d = dataclasses.replace(d, token_index=index)
        bounds = torch.searchsorted(rows.cpu(), torch.tensor([b for s in self.prefills for b in (s.start, s.end)]))
        prefills = []
        for span, lo, hi in zip(self.prefills, bounds[0::2].tolist(), bounds[1::2].tolist()):
            if lo < hi:
                prefills.append(_span_rows(span, rows_here[lo:hi] - span.start, lo, hi))
        return AttentionMetadata(self.slot_mapping.index_select(0, rows_here), prefills, d)


def _span_rows(span: PrefillSpan, local: torch.Tensor, start: int, end: int) -> PrefillSpan:
    """``span``'s queries ``local`` (ascending offsets into it) as a span at ``start:end``."""
    q_len, n = span.end - span.start, span.ctx_slots.numel()
    k = end - start
    if span.mask is None and span.positions is None:
        if int(local[0]) == q_len - k:  # its last k rows: still the context's last tokens
            return PrefillSpan(start, end, span.ctx_slots, None)
        positions = local + (n - q_len)
        mask = torch.arange(n, device=local.device)[None, :] <= positions[:, None]
        return PrefillSpan(start, end, span.ctx_slots, mask, positions)
    positions = None if span.positions is None else span.positions[local]
    return PrefillSpan(start, end, span.ctx_slots, None if span.mask is None else span.mask[local], positions)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: ``[T, heads, head_dim]``; caches: ``[slots, kv_heads, head_dim]``. Returns
    ``[T, heads, head_dim]``."""
    d = meta.decode
    if d is not None and not meta.prefills and d.token_index.numel() == q.shape[0]:
        # every token is a decode: the runner packs them in batch order (token_index = 0..B-1)
        return _decode_attention(q, k_cache, v_cache, d, scale)
    whole = meta.prefills[0] if d is None and len(meta.prefills) == 1 else None
    if whole is not None and whole.start == 0 and whole.end == q.shape[0] and (whole.mask is None or whole.positions is not None):
        o = prefill.prefill_attention(q, k_cache, v_cache, whole.ctx_slots, scale, whole.positions)
        if o is not None:  # one prompt span, the whole step: the kernel's output is the step's
            return o
    out = torch.empty_like(q)
    for span in meta.prefills:
        if span.mask is None or span.positions is not None:  # causal: the kernel reads the pool in place
            o = prefill.prefill_attention(q[span.start : span.end], k_cache, v_cache, span.ctx_slots, scale,
                                          span.positions)
            if o is not None:
                out[span.start : span.end] = o
                continue
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        k = k_cache.index_select(0, span.ctx_slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, span.ctx_slots).transpose(0, 1).unsqueeze(0)
        out[span.start : span.end] = _prefill_attention(qs, k, v, span.torch_mask, scale)[0].transpose(0, 1)
    if d is not None:
        out.index_copy_(0, d.token_index, _decode_attention(q.index_select(0, d.token_index), k_cache, v_cache, d, scale))
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      d: DecodeBatch, scale: float) -> torch.Tensor:
    """One query per sequence, ``q`` ``[B, H, D]`` -> ``[B, H, D]``.

    On a CPU with the compiled kernel (``model/kernels``) each sequence's K and V are read in
    place in the pool. Otherwise they are gathered into a padded copy, upcast to float32 on a CPU
    (torch's bfloat16 kernel runs a slow path for q_len == 1). Shared prefixes (cascade) are
    attended once per group either way and merged in."""
    if d.lens is not None and kernels.available(q, k_cache):
        o, lse = kernels.paged_decode_attention(q, k_cache, v_cache, d.ctx_slots, d.lens, scale)
        if d.shared:
            o = _merge_shared_prefixes(q.float(), o, lse, k_cache, v_cache, d, scale)
        return o.to(q.dtype)
    up = torch.float32 if q.device.type == "cpu" else q.dtype
    if d.shared:
        o, lse = _gathered_attention_with_lse(q.to(up), k_cache, v_cache, d, scale)
        return _merge_shared_prefixes(q.to(up), o, lse, k_cache, v_cache, d, scale).to(q.dtype)
    b, n = d.ctx_slots.shape
    slots = d.ctx_slots.reshape(-1)
    k = k_cache.index_select(0, slots).to(up).view(b, n, *k_cache.shape[1:]).transpose(1, 2)
    v = v_cache.index_select(0, slots).to(up).view(b, n, *v_cache.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2).to(up), k, v, attn_mask=d.mask, scale=scale, enable_gqa=True)
    return o.squeeze(2).to(q.dtype)


def _gathered_attention_with_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 d: DecodeBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence over its own ``d.ctx_slots``, gathered: output ``[B, H, D]`` and the
    log-sum-exp of its scaled scores ``[B, H]``, in ``q``'s dtype."""
    b, n = d.ctx_slots.shape
    kv_heads, dim = k_cache.shape[1:]
    qg = q.view(b, kv_heads, -1, dim)
    slots = d.ctx_slots.reshape(-1)
    k = k_cache.index_select(0, slots).to(q.dtype).view(b, n, kv_heads, dim)
    v = v_cache.index_select(0, slots).to(q.dtype).view(b, n, kv_heads, dim)
    s = torch.einsum("bgrd,bngd->bgrn", qg, k) * scale
    if d.mask is not None:
        s.masked_fill_(~d.mask.view(b, 1, 1, n), float("-inf"))
    lse = s.logsumexp(-1)  # [B, kv_heads, group]; finite: every row has its decode token
    o = torch.einsum("bgrn,bngd->bgrd", (s - lse[..., None]).exp_(), v)
    return o.reshape(b, -1, dim), lse.reshape(b, -1)


def _merge_shared_prefixes(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, d: DecodeBatch, scale: float) -> torch.Tensor:
    """Cascade attention: each shared prefix is attended by all its members' queries as one
    ``[kv_heads, members * group, D]`` product and merged with the members' own results ``o``
    ``[B, H, D]`` (log-sum-exps ``lse`` ``[B, H]``): with ``lse`` the log-sum-exp of each part's
    scores, ``o = o_own * exp(lse_own - lse) + o_prefix * exp(lse_prefix - lse)``, ``lse`` their
    logaddexp. ``q``, ``o`` and ``lse`` share the compute dtype; returns ``[B, H, D]``."""
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    qg = q.view(b, kv_heads, group, dim)
    o = o.view(b, kv_heads, group, dim)
    lse = lse.view(b, kv_heads, group)
    for prefix in d.shared:
        m = prefix.members
        qp = qg.index_select(0, m).transpose(0, 1).reshape(kv_heads, -1, dim)  # [kv_heads, n*group, D]
        kp = k_cache.index_select(0, prefix.slots).to(q.dtype).permute(1, 2, 0)  # [kv_heads, D, L]
        vp = v_cache.index_select(0, prefix.slots).to(q.dtype).transpose(0, 1)  # [kv_heads, L, D]
        sp = torch.bmm(qp, kp) * scale
        lse_p = sp.logsumexp(-1)
        op = torch.bmm((sp - lse_p[..., None]).exp_(), vp)
        op = op.view(kv_heads, len(m), group, dim).transpose(0, 1)
        lse_p = lse_p.view(kv_heads, len(m), group).transpose(0, 1)
        lse_own = lse.index_select(0, m)
        total = torch.logaddexp(lse_own, lse_p)
        merged = o.index_select(0, m) * (lse_own - total).exp_()[..., None] + op * (lse_p - total).exp_()[..., None]
        o.index_copy_(0, m, merged)
    return o.view(b, heads, dim)


def prefill_mask(q_len: int, ctx_len: int) -> torch.Tensor | None:
    """For torch's attention (where the prefill kernel does not serve): the mask of ``q_len`` new
    tokens at the end of a ``ctx_len`` context, or None (causal) where torch's fused causal kernel
    is the cheaper way to apply it.

    That kernel aligns its diagonal top-left and skips the masked half, while an explicit mask
    makes it compute every (query, key) pair. So when the cached past is short next to the new
    tokens, :func:`paged_attention` gives the past positions dummy queries (rows dropped after)
    and runs the causal kernel: measured 1.6x faster for 1,440 new tokens behind 30 cached, the
    same results bit for bit. A long past with few new tokens (the cache-hit case) is cheaper
    with the mask. Built once per span (:attr:`PrefillSpan.torch_mask`), shared by every layer.
    """
    past = ctx_len - q_len
    if past <= q_len // 2:
        return None
    return torch.ones(q_len, ctx_len, dtype=torch.bool).tril(diagonal=past)


def _prefill_attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q`` ``[1, H, Tq, D]`` over ``k``, ``v`` ``[1, Hkv, Tctx, D]``; ``mask`` None means
    causal with the queries at the context's last ``Tq`` positions (see :func:`prefill_mask`)."""
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    past = k.shape[2] - q.shape[2]
    if past:
        q = torch.cat((q.new_zeros(*q.shape[:2], past, q.shape[3]), q), dim=2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[:, :, past:]
