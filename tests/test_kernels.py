"""The C kernels of ``model/kernels`` against the torch operators they replace: the same
roundings in bfloat16, float32 within summation order, and the whole model's logits with the
kernels on and off (the torch path is the fallback on machines without a compiler)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmosaic.model import kernels
from kvmosaic.model.rotary import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(not kernels.elementwise_available(torch.zeros(1)),
                                reason="the CPU kernels are not built here (no C compiler)")
DTYPES = [torch.float32, torch.bfloat16]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm, written out."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_matches_transformers_numerics(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got, want = kernels.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    else:  # the float32 statistics may differ in the last bit: at most one bfloat16 step, rarely
        step = want.float().abs() * 2**-7
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8, 100, 1000])
def test_rms_norm_rows_of_any_width(dtype, hidden):
    """Widths that are no multiple of a vector: the last lanes of a row are masked, never read or
    written past it (the residual's next row and the output's are left as they were)."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(6, hidden, generator=g) * 2).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    stream = torch.randn(7, hidden, generator=g).to(dtype)  # one row more than x: must stay untouched
    before = stream.clone()
    got = kernels.rms_norm(x, weight, 1e-5, stream[:6])
    assert torch.equal(stream[:6], x + before[:6]) and torch.equal(stream[6], before[6])
    want = hf_rms_norm(x + before[:6], weight, 1e-5)
    step = want.float().abs() * (2**-7 if dtype == torch.bfloat16 else 1e-6) + 1e-6
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    weight = torch.rand(64, generator=g).to(dtype)
    expected_sum = x + residual
    stream = residual.clone()
    got = kernels.rms_norm(x, weight, 1e-6, stream)
    assert torch.equal(stream, expected_sum)
    torch.testing.assert_close(got, kernels.rms_norm(expected_sum, weight, 1e-6), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_rope_in_place_equals_torch_bit_for_bit(dtype, dim):
    """On a strided view like the one the model rotates (q and k inside the fused qkv output);
    head sizes whose half is a multiple of 16 (vectors) and one that is not (the scalar loop)."""
    tokens, heads, kv_heads = 7, 9, 3
    rotary = RotaryEmbedding(dim, 10000.0, 4096)
    pos = torch.tensor([0, 1, 2, 500, 501, 4000, 4095])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, sin = rotary(pos, dtype)
    want = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    view = qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)
    got = kernels.rope_(view, rotary.cos[pos], rotary.signed_sin[pos])
    assert got.data_ptr() == view.data_ptr()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_rope_store_rotates_and_writes_the_pool_as_rope_then_a_write(dtype, dim):
    """``rope_store``: the fused QKV rows rotated in place (q and k heads) and each token's k and v
    written at its slot: the same bits as torch's rotation and ``index_copy_``; other slots untouched.
    Values down to the subnormal range, where the bfloat16 rounding takes its exact path."""
    tokens, heads, kv_heads = 9, 9, 3
    rotary = RotaryEmbedding(dim, 10000.0, 4096)
    pos = torch.tensor([0, 1, 2, 3, 500, 501, 4000, 4094, 4095])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    qkv[3] *= 1e-38  # subnormal products
    k_pool, v_pool = (torch.randn(40, kv_heads, dim).to(dtype) for _ in range(2))
    slots = torch.tensor([5, 17, 0, 39, 8, 9, 10, 30, 2])
    cos, sin = rotary(pos, dtype)
    want_qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k.index_copy_(0, slots, want_qk[:, heads:])
    want_v.index_copy_(0, slots, qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))
    assert kernels.rope_store(qkv, heads, kv_heads, rotary.cos[pos], rotary.signed_sin[pos], slots, k_pool, v_pool)
    assert torch.equal(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), want_qk)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert not kernels.rope_store(qkv, heads, kv_heads, rotary.cos[pos], rotary.signed_sin[pos], slots.int(), k_pool,
                                  v_pool), "int32 slots: not the kernel's layout"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_rounds_as_torch(dtype, rows):
    """``F.silu(gate) * up`` of the fused gate/up output: bfloat16 equal to torch but for rare ties
    of SiLU's exp (the kernels' own, ~1e-7 relative, clamped at exp(88): silu(-90) is -5e-37
    where torch's exp overflows to give -0); float32 within that exp's error. A width that is not
    a multiple of 16 runs the scalar tail, which agrees with the vector loop."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1539, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 20.0, -20.0])
    gate, up = x.chunk(2, dim=-1)
    got, want = kernels.silu_mul(x), F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (rows, 1539)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        step = want.float().abs() * 2**-7 + 1e-35
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got == want).float().mean() > 0.999
    tail = kernels.silu_mul(x[:, list(range(1536, 1539)) + list(range(1539 + 1536, 3078))].contiguous())
    assert torch.equal(tail, got[:, 1536:])  # the scalar tail against the vector loop, same elements
    strided = torch.cat([x, x[:, :5]], dim=1)[:, : 2 * 1539]  # rows with a longer stride
    assert torch.equal(kernels.silu_mul(strided), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_with_and_without_the_kernels(dtype, monkeypatch):
    """The shipped model's logits over a prefill and a batched decode, kernels on against the
    torch operators; float32 within summation order, bfloat16 within its rounding: the prefill's as
    close to the float32 model's as the operators' (bfloat16's own error there reaches a cosine of
    ~0.96 for a row, where the two paths differ by at most ~2e-3 in a row)."""
    from kvmosaic.kv.paged import PagedKVCache
    from kvmosaic.model import load_model_bundle
    from kvmosaic.model.attention import AttentionMetadata, DecodeBatch, PrefillSpan

    bundle = load_model_bundle(None, "float32" if dtype == torch.float32 else "bfloat16", "cpu")
    ids = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(0))

    def run(bundle=bundle, dtype=dtype):
        kv = PagedKVCache(bundle.config, 8, 16, dtype)
        slots = torch.arange(40)
        prefill = bundle.model(ids, torch.arange(40), kv, AttentionMetadata(slots, [PrefillSpan(0, 40, slots, None)]))
        ctx = [torch.arange(20), torch.arange(41)]  # two decodes over the prefill's KV
        kv.k[0][40], kv.v[0][40] = kv.k[0][39], kv.v[0][39]
        lens = torch.tensor([20, 41])
        padded = torch.nn.utils.rnn.pad_sequence(ctx, batch_first=True)
        mask = (torch.arange(41)[None, :] < lens[:, None])[:, None, None, :]
        decode = DecodeBatch(torch.arange(2), padded, mask, [], lens)
        logits = bundle.model(ids[[19, 39]], torch.tensor([19, 40]), kv,
                              AttentionMetadata(torch.tensor([60, 40]), [], decode))
        return prefill, logits

    on = run()
    monkeypatch.setattr(kernels, "elementwise_available", lambda x: False)
    monkeypatch.setattr(kernels, "available", lambda q, k: False)
    off = run()
    # bfloat16 logits of 16-32 are multiples of 0.125; one rounding that falls the other way
    # (float32 summation order) moves a few of them by a few steps after 30 layers. float32:
    # largest measured 1.08e-4 on an AVX2 EPYC (logits of ~10-20: a relative 1e-5)
    tol = 2e-4 if dtype == torch.float32 else 1.0
    for a, b in zip(on, off):
        assert (a - b).abs().max().item() < tol
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    if dtype == torch.float32:
        assert F.cosine_similarity(on[0], off[0], dim=-1).min() > 0.999
        return
    exact = run(load_model_bundle(None, "float32", "cpu"), torch.float32)[0]
    on_err, off_err = (1 - F.cosine_similarity(x.float(), exact, dim=-1) for x in (on[0], off[0]))
    assert on_err.mean() <= off_err.mean() + 1e-4
    assert F.cosine_similarity(on[0], off[0], dim=-1).min() > 0.995
