"""The causal prefill attention kernel (model/kernels/prefill.py, prefill_attention.c;
docs/ARCHITECTURE.md, "Prefill attention"), bfloat16 and float32: as accurate as torch's own
attention in the same dtype against float64, a query row's result the same bits whatever part of
its context came from the cache, and the engine's greedy outputs with it, cache on and off, the same
bits where the CPU's bfloat16 GEMMs are row-invariant and else within the stated bfloat16 tolerance
(float32: tests/test_cache_equivalence.py's 1e-4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmosaic import SamplingParams
from kvmosaic.model.kernels import prefill
from tests.conftest import assert_greedy_within, make_llm, packed_gemm_rows_invariant, record_logits
from tests.test_batch_composition import BF16_LOGIT_TOL

DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not prefill._checked(dtype), reason=f"no {dtype} kernel here"))
          for dtype in (torch.bfloat16, torch.float32)]


def _case(num_tokens: int, past: int, heads: int, kv_heads: int, dim: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    ctx = past + num_tokens
    k, v = (torch.randn(ctx + 13, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(ctx + 13, generator=g)[:ctx]  # the pool in any order, as blocks are
    q = torch.randn(num_tokens, heads, dim, generator=g).to(dtype)
    return q, k, v, slots


def _reference(q, k, v, slots, scale, dtype):
    """torch's attention on gathered copies in ``dtype``, causal with the queries last."""
    num_tokens, heads, _ = q.shape
    past, group = slots.numel() - num_tokens, heads // k.shape[1]
    mask = torch.ones(num_tokens, slots.numel(), dtype=torch.bool).tril(past)
    kk, vv = (x[slots].to(dtype).transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
    out = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "past", "heads", "kv_heads", "dim"), [
    (1, 0, 4, 4, 64), (1, 90, 9, 3, 64), (37, 0, 9, 3, 64), (150, 0, 9, 3, 64), (29, 200, 6, 2, 64),
    (64, 0, 32, 8, 128), (5, 70, 8, 8, 128),
])
def test_as_accurate_as_torch_in_the_same_dtype(num_tokens, past, heads, kv_heads, dim, dtype):
    q, k, v, slots = _case(num_tokens, past, heads, kv_heads, dim, dtype=dtype)
    scale = dim**-0.5
    out = prefill.prefill_attention(q, k, v, slots, scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    exact = _reference(q, k, v, slots, scale, torch.float64)
    same_dtype = _reference(q, k, v, slots, scale, dtype)
    err, torch_err = (out.double() - exact).abs().max().item(), (same_dtype.double() - exact).abs().max().item()
    floor = 2e-3 if dtype == torch.bfloat16 else 1e-6
    assert err <= 1.5 * torch_err + floor, f"kernel {err} vs torch {dtype} {torch_err}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_a_row_does_not_depend_on_what_came_from_the_cache(dim, dtype):
    """The same rows computed with all of the prompt in the step, with its first part cached
    (only the rest as queries), and one at a time: the same bits. 161 tokens: several of the
    kernels' key steps, tiles of rows that reach into a step by different amounts."""
    q, k, v, slots = _case(161, 0, 6, 2, dim, seed=1, dtype=dtype)
    whole = prefill.prefill_attention(q, k, v, slots, 0.1)
    for cached in (1, 16, 33, 60, 97, 150):
        tail = prefill.prefill_attention(q[cached:], k, v, slots, 0.1)
        assert torch.equal(tail, whole[cached:]), f"{cached} cached tokens changed the rows after them"
    for row in (0, 7, 31, 60, 64, 100, 160):
        one = prefill.prefill_attention(q[row : row + 1], k, v, slots[: row + 1], 0.1)
        assert torch.equal(one[0], whole[row])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_a_running_maximum_that_moves_along_the_context(dim, dtype):
    """Keys that grow along the context, so each row's running maximum moves in many key steps and its
    accumulator is scaled there: as accurate as torch, and a row the same bits whatever shares its tiles
    and whatever came from the cache."""
    q, k, v, slots = _case(300, 0, 6, 2, dim, seed=4, dtype=dtype)
    growth = torch.ones(k.shape[0])
    growth[slots] = torch.linspace(0.2, 4.0, slots.numel())
    k = (k.float() * growth[:, None, None]).to(dtype)
    scale = dim**-0.5
    whole = prefill.prefill_attention(q, k, v, slots, scale)
    exact = _reference(q, k, v, slots, scale, torch.float64)
    torch_err = (_reference(q, k, v, slots, scale, dtype).double() - exact).abs().max().item()
    assert (whole.double() - exact).abs().max().item() <= 1.5 * torch_err + (2e-3 if dtype == torch.bfloat16 else 1e-6)
    for cached in (5, 64, 130, 299):
        assert torch.equal(prefill.prefill_attention(q[cached:], k, v, slots, scale), whole[cached:])
    for row in (63, 64, 200, 299):
        assert torch.equal(prefill.prefill_attention(q[row : row + 1], k, v, slots[: row + 1], scale)[0], whole[row])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_queries_at_any_positions_are_the_rows_of_the_whole_prefill(dim, dtype):
    """A blend recomputes scattered tokens (``positions``): each is the same bits as its row in
    the whole prompt's prefill (a row depends on its query, position and context only), and
    the kernel agrees with torch's masked attention the blend ran before."""
    q, k, v, slots = _case(161, 0, 6, 2, dim, seed=2, dtype=dtype)
    whole = prefill.prefill_attention(q, k, v, slots, 0.1)
    positions = torch.tensor([0, 3, 4, 17, 30, 31, 32, 45, 59, 60, 63, 64, 65, 100, 127, 128, 141, 150, 151, 152, 153,
                              154, 155, 156, 157, 158, 159, 160, 2])
    picked = prefill.prefill_attention(q[positions], k, v, slots, 0.1, positions)
    assert torch.equal(picked, whole[positions])
    mask = torch.arange(161)[None, :] <= positions[:, None]
    kk, vv = (x[slots].double().transpose(0, 1).repeat_interleave(3, 0) for x in (k, v))
    exact = F.scaled_dot_product_attention(q[positions].double().transpose(0, 1), kk, vv, attn_mask=mask,
                                           scale=0.1).transpose(0, 1)
    assert (picked.double() - exact).abs().max().item() < (3e-2 if dtype == torch.bfloat16 else 1e-5)
    assert prefill.prefill_attention(q[:2], k, v, slots, 0.1, torch.tensor([5, 161])) is None  # past the context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_rows_of_a_long_context_whatever_their_tile_reaches(dim, dtype):
    """A 700-token context (the bfloat16 kernel's keys go by in passes of 256): scattered queries
    whose tiles mix rows that end in the first pass with rows that reach the third are each the
    same bits as their row of the whole prefill and of a prefill of that row alone, and as
    accurate as torch in the same dtype."""
    q, k, v, slots = _case(700, 0, 6, 2, dim, seed=5, dtype=dtype)
    scale = dim**-0.5
    whole = prefill.prefill_attention(q, k, v, slots, scale)
    exact = _reference(q, k, v, slots, scale, torch.float64)
    torch_err = (_reference(q, k, v, slots, scale, dtype).double() - exact).abs().max().item()
    assert (whole.double() - exact).abs().max().item() <= 1.5 * torch_err + (2e-3 if dtype == torch.bfloat16 else 1e-6)
    positions = torch.tensor([3, 699, 255, 256, 40, 511, 512, 600, 1, 300, 257, 0, 640, 98, 513, 254, 699 - 31])
    assert torch.equal(prefill.prefill_attention(q[positions], k, v, slots, scale, positions), whole[positions])
    for row in (255, 256, 511, 699):
        assert torch.equal(prefill.prefill_attention(q[row : row + 1], k, v, slots[: row + 1], scale)[0], whole[row])


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_read_in_place_from_the_fused_projection(dtype):
    """q as the layer hands it over, a view of the QKV projection's rows (tokens further apart
    than its heads): the same bits as from a contiguous copy."""
    q, k, v, slots = _case(45, 20, 6, 2, 64, seed=3, dtype=dtype)
    qkv = torch.cat((q.flatten(1), torch.randn(45, 2 * 2 * 64).to(dtype)), dim=1)
    view = qkv[:, : 6 * 64].view(45, 6, 64)
    assert not view.is_contiguous()
    assert torch.equal(prefill.prefill_attention(view, k, v, slots, 0.125),
                       prefill.prefill_attention(q.contiguous(), k, v, slots, 0.125))


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="no AMX on this CPU")
def test_bfloat16_runs_on_amx_tiles_where_the_cpu_has_them():
    """The tests of this file then check the tile kernel (prefill_attention_amx.c): its accuracy, and a row
    the same bits whatever came from the cache or shares its tile."""
    assert prefill.on_amx_tiles()


def test_declines_what_it_does_not_serve():
    q, k, v, slots = _case(8, 4, 4, 2, 64)
    assert prefill.prefill_attention(q.float(), k, v, slots, 0.125) is None  # dtypes that differ
    assert prefill.prefill_attention(q.half(), k.half(), v.half(), slots, 0.125) is None  # float16
    q96, k96, v96, slots96 = _case(8, 4, 4, 2, 96)
    assert prefill.prefill_attention(q96, k96, v96, slots96, 0.125) is None  # head dim 96


@pytest.mark.skipif(not prefill._checked(torch.bfloat16), reason="no bfloat16 kernel here")
def test_engine_greedy_cache_on_and_off_in_bfloat16(tokenizer, monkeypatch):
    """Cached prefixes, chunked prefill: the same logits, bit for bit, as with the cache off where
    this CPU's bfloat16 GEMMs give a row the same bits at any row count (AVX-512 without AMX:
    measured on a Zen 4 EPYC, tails of 3-40 tokens behind 384 cached); else greedy tokens within
    the bfloat16 tolerance (an AMX Xeon's GEMMs change a row's result past 32 rows:
    test_batch_composition.py)."""
    text = "The river carried stones past the old mill while the lamp burned. " * 8
    stem = tokenizer.encode(text, add_special_tokens=False)
    prompts = [stem + tokenizer.encode(tail, add_special_tokens=False)
               for tail in (" Then the miller", " Later that night", " The stones were")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    served, kernel = [0], prefill.prefill_attention

    def counting(*args):
        out = kernel(*args)
        served[0] += out is not None
        return out

    monkeypatch.setattr(prefill, "prefill_attention", counting)
    runs = []
    for opts in ({"enable_prefix_caching": False}, {}, {"max_num_batched_tokens": 48}):
        llm = make_llm(dtype="bfloat16", **opts)
        logits = record_logits(llm)
        outs = [llm.generate([p], params)[0] for p in prompts]
        runs.append(([o.token_ids for o in outs], [logits[o.request_id] for o in outs], llm))
    assert served[0] >= 3 * 30, "the kernel served the prefills"
    (off_tokens, off_logits, _), *cached = runs
    exact = packed_gemm_rows_invariant(torch.bfloat16)
    for tokens, logits, llm in cached:
        assert llm.get_stats().prefix_cache_hits > 0
        if exact:
            assert tokens == off_tokens
            assert all(torch.equal(a, b) for one, other in zip(logits, off_logits) for a, b in zip(one, other, strict=True))
        else:
            assert_greedy_within(BF16_LOGIT_TOL, off_tokens, tokens, off_logits, logits)
        llm.engine.pool.check_invariants()


@pytest.mark.skipif(not prefill._checked(torch.bfloat16), reason="no bfloat16 kernel here")
def test_a_long_cached_past_changes_no_bit_in_bfloat16(tokenizer, monkeypatch):
    """A prompt behind a cached prefix more than twice as long as its new tokens (where torch's
    attention takes an explicit mask) is attended by the same kernel as with the cache off, so its
    logits are the same bits, every step, where this CPU's bfloat16 GEMMs give a row the same bits
    at any row count. An AMX Xeon's do not (at two threads the down projection's rows change up to
    ~340 rows): there the kernel serves every span and the greedy tokens keep the bfloat16
    tolerance. Before, such a span ran torch's attention on gathered copies and changed the first
    token of 3 of 4 probed ~1,900-token prompts."""
    stem = tokenizer.encode("The river carried stones past the old mill while the lamp burned. " * 18,
                            add_special_tokens=False)
    tails = [tokenizer.encode(t * 6, add_special_tokens=False)
             for t in (" Then the miller counted the sacks.", " Later that night the wind turned.")]
    assert len(stem) > 2 * max(map(len, tails)) and min(map(len, tails)) > 32
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    declined, kernel = [0], prefill.prefill_attention

    def counting(*args, **kwargs):
        out = kernel(*args, **kwargs)
        declined[0] += out is None
        return out

    monkeypatch.setattr(prefill, "prefill_attention", counting)
    runs = []
    for opts in ({"enable_prefix_caching": False}, {}):
        llm = make_llm(dtype="bfloat16", **opts)
        llm.generate([stem], SamplingParams(max_tokens=1))
        logits = record_logits(llm)
        outs = [llm.generate([stem + t], params)[0] for t in tails]
        runs.append((outs, [logits[o.request_id] for o in outs]))
    (off, off_logits), (on, on_logits) = runs
    assert declined[0] == 0, "the kernel served every span"
    assert [o.num_cached_tokens for o in on] == [len(stem) // 16 * 16] * 2
    if packed_gemm_rows_invariant(torch.bfloat16):
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        for a, b in zip(off_logits, on_logits):
            assert torch.equal(torch.stack(a), torch.stack(b))
    else:
        assert_greedy_within(BF16_LOGIT_TOL, [o.token_ids for o in off], [o.token_ids for o in on], off_logits,
                             on_logits)
