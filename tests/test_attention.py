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


def _decode_meta(ctxs: list[torch.Tensor], shared=()):
    from kvmosaic.model.attention import DecodeBatch

    lens = torch.tensor([len(c) for c in ctxs])
    padded = torch.nn.utils.rnn.pad_sequence(ctxs, batch_first=True)
    mask = (torch.arange(padded.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    return AttentionMetadata(torch.arange(len(ctxs)), [],
                             DecodeBatch(torch.arange(len(ctxs)), padded, mask, list(shared), lens))


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decode attention through the compiled in-place kernel (model/kernels) and through the
    torch path that gathers the contexts: both must meet the same references."""
    from kvmosaic.model import kernels

    if request.param == "torch":
        monkeypatch.setattr(kernels, "available", lambda q, k: False)
    elif not kernels.available(torch.zeros(1, 4, 16), torch.zeros(1, 2, 16)):
        pytest.skip("the CPU kernel is not built here (no C compiler)")
    return request.param


@pytest.mark.parametrize("prefix_len", [1, 64, 300])
def test_cascade_decode_equals_plain_decode(prefix_len, decode_path):
    """Decodes sharing a prefix: the prefix attended once (cascade) and each tail on its own,
    merged by log-sum-exp, equals every sequence attending its whole context — and a float64
    softmax(QK^T)V. Two groups, one sequence outside both, tails of different lengths."""
    from kvmosaic.model.attention import SharedPrefix

    torch.manual_seed(prefix_len)
    heads, kv_heads, d, pool = 9, 3, 64, 4000
    pool_k, pool_v = torch.randn(pool, kv_heads, d), torch.randn(pool, kv_heads, d)
    slots = torch.randperm(pool)
    prefix_a, prefix_b = slots[:prefix_len], slots[prefix_len : 2 * prefix_len]
    tails = [slots[1000 + 50 * i : 1000 + 50 * i + n] for i, n in enumerate([1, 7, 33, 2, 19, 40])]
    heads_of = [prefix_a, prefix_a, prefix_a, prefix_b, prefix_b, prefix_a[:0]]
    full = [torch.cat((h, t)) for h, t in zip(heads_of, tails)]
    q = torch.randn(len(full), heads, d)
    plain = paged_attention(q, pool_k, pool_v, _decode_meta(full), 0.125)
    groups = [SharedPrefix(prefix_a, torch.tensor([0, 1, 2])), SharedPrefix(prefix_b, torch.tensor([3, 4]))]
    cascade = paged_attention(q, pool_k, pool_v, _decode_meta(tails, groups), 0.125)
    torch.testing.assert_close(cascade, plain, atol=1e-6, rtol=0)
    for i, ctx in enumerate(full):
        ref = reference(q[i : i + 1], pool_k[ctx], pool_v[ctx], torch.tensor([len(ctx) - 1]), 0.125)
        torch.testing.assert_close(cascade[i : i + 1].double(), ref, atol=1e-5, rtol=0)


def test_shared_prefixes_groups_rows_by_their_common_leading_blocks():
    from kvmosaic.engine.model_runner import shared_prefixes

    tables = [
        [5, 6, 7, 8, 20],   # 0: shares 5 6 7 with 1 and 2
        [5, 6, 7, 9],       # 1
        [5, 6, 7, 8, 21],   # 2
        [30, 31, 32],       # 3: alone
        [40, 41, 42, 43],   # 4: shares 40 41 42 with 5, cut to leave 5 a token of its own
        [40, 41, 42, 43],   # 5
        [],                 # 6: no blocks yet
    ]
    ctx = [70, 60, 66, 40, 64, 49, 0]
    assert shared_prefixes(tables, ctx, 16, 1) == [(3, [0, 1, 2]), (3, [4, 5])]
    assert shared_prefixes(tables, ctx, 16, 4) == []
    assert shared_prefixes([[1, 2], [1, 2]], [17, 17], 16, 1) == [(1, [0, 1])]
    assert shared_prefixes([[1, 2], [1, 2]], [16, 17], 16, 1) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_the_pool_matches_a_float64_reference(dtype, decode_path):
    """Batched decode with contexts of 1 to 700 tokens at scattered slots, in both pool dtypes:
    each row equals a float64 softmax(QK^T)V over that row's own context (128, 129, 257: the
    kernel attends a context in chunks of 128 keys and merges them)."""
    torch.manual_seed(7)
    heads, kv_heads, d, pool = 9, 3, 64, 3000
    pool_k, pool_v = torch.randn(pool, kv_heads, d).to(dtype), torch.randn(pool, kv_heads, d).to(dtype)
    ctxs = [torch.randperm(pool)[:n] for n in (1, 31, 32, 33, 700, 5, 128, 129, 257)]
    q = torch.randn(len(ctxs), heads, d).to(dtype)
    out = paged_attention(q, pool_k, pool_v, _decode_meta(ctxs), 0.125)
    assert out.dtype == dtype
    for i, ctx in enumerate(ctxs):
        ref = reference(q[i : i + 1].float(), pool_k[ctx].float(), pool_v[ctx].float(), torch.tensor([len(ctx) - 1]), 0.125)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("prefix_len", [128, 300, 700])
def test_decodes_sharing_a_prefix_give_each_row_the_bits_it_gets_alone(prefix_len, decode_path):
    """bfloat16 rows whose contexts share a prefix's slots (on AMX tiles one task attends a shared chunk for up to
    16 query rows at once, paged_decode_share): each row's output is the same bits as when it is decoded alone,
    and as when its prefix's keys sit at slots of its own (nothing shared) — a row's figures never depend on who
    else attends its keys. Ten rows: more than one lead's share of a chunk (5 rows of 3 q heads). The torch path
    (no C compiler) pads the batch's contexts to one length and masks them, and torch's float32 kernel sums a
    padded row in another order than an unpadded one: there a row alone is within one bfloat16 step (2^-7 of
    its value) of the batch's, and the same bits only where its rounding falls the same way (one of 5,760
    figures differed on a Zen 5 EPYC)."""
    torch.manual_seed(prefix_len)
    heads, kv_heads, d, pool = 9, 3, 64, 12000
    pool_k, pool_v = (torch.randn(pool, kv_heads, d).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(pool)
    prefix = slots[:prefix_len]
    tails = [slots[1000 + 60 * i : 1000 + 60 * i + n] for i, n in enumerate([1, 7, 33, 2, 19, 40, 5, 60, 11, 3])]
    shared = [torch.cat((prefix, t)) for t in tails]
    copies = []  # each row's prefix keys copied to slots of its own
    for i, t in enumerate(tails):
        own = slots[2000 + i * 1000 : 2000 + i * 1000 + prefix_len]
        pool_k[own], pool_v[own] = pool_k[prefix], pool_v[prefix]
        copies.append(torch.cat((own, t)))
    q = torch.randn(len(tails), heads, d).to(torch.bfloat16)
    together = paged_attention(q, pool_k, pool_v, _decode_meta(shared), 0.125)
    apart = paged_attention(q, pool_k, pool_v, _decode_meta(copies), 0.125)
    assert torch.equal(together, apart)
    for i, ctx in enumerate(shared):
        alone = paged_attention(q[i : i + 1], pool_k, pool_v, _decode_meta([ctx]), 0.125)
        if decode_path == "torch":
            torch.testing.assert_close(together[i : i + 1].float(), alone.float(), atol=0, rtol=2**-7)
        else:
            assert torch.equal(together[i : i + 1], alone)
        ref = reference(q[i : i + 1].float(), pool_k[ctx].float(), pool_v[ctx].float(), torch.tensor([len(ctx) - 1]), 0.125)
        torch.testing.assert_close(together[i : i + 1].double(), ref, atol=1e-2, rtol=0)
