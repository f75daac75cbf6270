"""Sliding-window views of a step's metadata (model/window.py) and capped-score attention
(model/softcap.py) against attention written out position by position (float32)."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.model import softcap as softcap_module
from kvmosaic.model.attention import AttentionMetadata, DecodeBatch, PrefillSpan, SharedPrefix, paged_attention
from kvmosaic.model.softcap import softcap_paged_attention
from kvmosaic.model.window import layer_view

H, HKV, D, BLOCK = 4, 2, 8, 4


def dense(q, k, v, window, scale, softcap=None):
    """One query ``[H, D]`` at the last of ``k``'s positions, over the keys its window sees."""
    if window is not None:
        k, v = k[-window:], v[-window:]
    s = torch.einsum("hd,khd->hk", q, k.repeat_interleave(H // HKV, dim=1)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hk,khd->hd", s.softmax(-1), v.repeat_interleave(H // HKV, dim=1))


def make_step(g):
    """A pool and a step: a prefill chunk of 9 tokens behind 15 cached, a full 6-token prefill,
    and three decodes of which two share a 3-block prefix (a cascade group)."""
    pool_k, pool_v = torch.randn(64 * BLOCK, HKV, D, generator=g), torch.randn(64 * BLOCK, HKV, D, generator=g)
    perm = torch.randperm(64 * BLOCK, generator=g)
    take = iter(perm.split([24, 6, 12, 5, 7, 20, 64 * BLOCK - 74]))
    chunk_ctx, full_ctx, shared, own_a, own_b, solo = (next(take) for _ in range(6))
    prefills = [PrefillSpan(0, 9, chunk_ctx, None), PrefillSpan(9, 15, full_ctx, None)]
    ctx_a, ctx_b = torch.cat((shared, own_a)), torch.cat((shared, own_b))
    rows = [own_a, own_b, solo]
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lens = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(padded.shape[1])[None] < lens[:, None])[:, None, None, :]
    decode = DecodeBatch(torch.tensor([15, 16, 17]), padded, mask, [SharedPrefix(shared, torch.tensor([0, 1]))])
    meta = AttentionMetadata(torch.zeros(18, dtype=torch.long), prefills, decode)
    contexts = [chunk_ctx[: 15 + i + 1] for i in range(9)] + [full_ctx[: i + 1] for i in range(6)] + [ctx_a, ctx_b, solo]
    return pool_k, pool_v, meta, contexts


@pytest.mark.parametrize("window", [None, 3, 7, 16, 100])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_windowed_attention_matches_dense(window, softcap, monkeypatch):
    monkeypatch.setattr(softcap_module, "QUERY_CHUNK", 4)  # several query chunks per span
    g = torch.Generator().manual_seed(window or 0)
    pool_k, pool_v, meta, contexts = make_step(g)
    q = torch.randn(18, H, D, generator=g)
    view = layer_view(meta, window) if (window is not None or softcap is not None) else meta
    if softcap is None:
        out = paged_attention(q, pool_k, pool_v, view, 0.3)
    else:
        out = softcap_paged_attention(q, pool_k, pool_v, view, 0.3, softcap)
    for t, ctx in enumerate(contexts):
        want = dense(q[t], pool_k[ctx], pool_v[ctx], window, 0.3, softcap)
        assert torch.allclose(out[t], want, atol=1e-5), f"token {t}, window {window}"


def test_layer_view_dissolves_cascade_and_trims_decode():
    pool_k, pool_v, meta, contexts = make_step(torch.Generator().manual_seed(1))
    view = layer_view(meta, 5)
    assert view.decode.shared == [] and view.decode.ctx_slots.shape == (3, 5)
    for row, ctx in enumerate(contexts[-3:]):
        assert torch.equal(view.decode.ctx_slots[row], ctx[-5:])
    # a chunk of 9 queries behind 15 cached tokens sees from position 15 - 5 + 1 = 11 on
    assert torch.equal(view.prefills[0].ctx_slots, meta.prefills[0].ctx_slots[11:])
    assert view.prefills[1].mask is not None  # 6 tokens, window 5: the last does not see the first
    assert layer_view(meta, 6).prefills[1] is meta.prefills[1]  # window 6: every query sees all
