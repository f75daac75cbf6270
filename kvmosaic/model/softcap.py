"""Paged attention with capped scores (Gemma 2): ``cap * tanh(scores / cap)`` before the mask
and the softmax, as transformers' eager attention does.

PyTorch's fused kernels cannot cap scores, so this path computes them explicitly, in float32,
query chunk by query chunk (bounding the score tensor's memory). It reads the same metadata as
:func:`~.attention.paged_attention` except cascade groups, which the caller dissolves first
(:func:`~.window.layer_view`).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata

QUERY_CHUNK = 512


def softcap_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, softcap: float) -> torch.Tensor:
    """q: ``[T, heads, head_dim]``; caches: ``[slots, kv_heads, head_dim]``. Returns ``[T, heads, head_dim]``."""
    out = torch.empty_like(q)
    for span in meta.prefills:
        k = k_cache.index_select(0, span.ctx_slots)[None]
        v = v_cache.index_select(0, span.ctx_slots)[None]
        n, q_len = k.shape[1], span.end - span.start
        mask = span.mask
        if mask is None:  # causal, the span's queries being the context's last tokens
            mask = torch.ones(q_len, n, dtype=torch.bool, device=q.device).tril(diagonal=n - q_len)
        for a in range(0, q_len, QUERY_CHUNK):
            b = min(a + QUERY_CHUNK, q_len)
            qs = q[span.start + a : span.start + b][None]
            out[span.start + a : span.start + b] = _attend(qs, k, v, mask[a:b][None, None, None], scale, softcap)[0]
    d = meta.decode
    if d is not None:
        assert not d.shared, "dissolve cascade groups first (window.layer_view)"
        bsz, n = d.ctx_slots.shape
        slots = d.ctx_slots.reshape(-1)
        k = k_cache.index_select(0, slots).view(bsz, n, *k_cache.shape[1:])
        v = v_cache.index_select(0, slots).view(bsz, n, *v_cache.shape[1:])
        mask = None if d.mask is None else d.mask.view(bsz, 1, 1, 1, n)
        o = _attend(q.index_select(0, d.token_index)[:, None], k, v, mask, scale, softcap)
        out.index_copy_(0, d.token_index, o[:, 0])
    return out


def _attend(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """``q`` ``[B, Tq, H, D]`` over ``k``, ``v`` ``[B, Tk, Hkv, D]``; ``mask`` broadcasts to
    ``[B, Hkv, group, Tq, Tk]`` (True: attend) or is None. Returns ``[B, Tq, H, D]``."""
    bsz, tq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.float().view(bsz, tq, kv_heads, heads // kv_heads, dim)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.float())
    return o.reshape(bsz, tq, heads, dim).to(q.dtype)
