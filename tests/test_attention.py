"""Prefill attention over the paged pool against a plain softmax(QK^T)V reference: with no
mask, the span's queries are the context's last tokens, however long the cached past."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.model.attention import AttentionMetadata, PrefillSpan, paged_attention


def reference(q, k, v, q_pos, scale):
    """q ``[T, H, D]``, k/v ``[N, Hkv, D]``, queries at positions ``q_pos``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q.double(), k.double()) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v.double())


@pytest.mark.parametrize("new, past", [(40, 0), (40, 3), (40, 20), (40, 21), (8, 100), (1, 0)])
def test_causal_span_behind_a_cached_past(new, past):
    torch.manual_seed(new * 1000 + past)
    n, heads, kv_heads, d = new + past, 6, 2, 16
    pool_k, pool_v = torch.randn(3 * n, kv_heads, d), torch.randn(3 * n, kv_heads, d)
    ctx = torch.randperm(3 * n)[:n]  # the context lives at scattered slots
    q = torch.randn(new, heads, d)
    meta = AttentionMetadata(ctx[past:], [PrefillSpan(0, new, ctx, None)])
    out = paged_attention(q, pool_k, pool_v, meta, 0.25)
    ref = reference(q, pool_k[ctx], pool_v[ctx], torch.arange(past, n), 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_explicit_mask_for_scattered_queries():
    torch.manual_seed(0)
    n = 50
    pool_k, pool_v = torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    q_pos = torch.tensor([3, 10, 11, 30, 49])
    q = torch.randn(len(q_pos), 4, 16)
    mask = torch.arange(n)[None, :] <= q_pos[:, None]
    meta = AttentionMetadata(q_pos, [PrefillSpan(0, len(q_pos), torch.arange(n), mask)])
    out = paged_attention(q, pool_k, pool_v, meta, 0.25)
    torch.testing.assert_close(out.double(), reference(q, pool_k, pool_v, q_pos, 0.25), atol=1e-5, rtol=0)
