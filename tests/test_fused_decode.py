"""The fused decode step (model/fused_decode.py, kernels/decode_step.c; docs/ARCHITECTURE.md,
"The fused decode step"): where it serves, what it changes and what it must not.

* Against the layer-by-layer path its logits stay within a stated tolerance (``FUSED_LOGIT_TOL``:
  both sum in float32, in another order), greedy tokens part only at near ties (float32: equal),
  and it is no further from transformers' float32 than the layer-by-layer path is.
* A row's result does not depend on the rest of the batch: bit for bit the same alone; nor on
  the weights' layout (tests/test_fused_decode_layouts.py).
* It declines what it does not compute (int8 weights, prefills in the step, cascade groups,
  ``KVMOSAIC_FUSED_DECODE=0``), and those steps run layer by layer.
* It computes on a GGUF's Q4_1 blocks (``quantization="gguf"``) as the layer path does, in float32 and
  in bfloat16 (there up to the rows the layer path computes on the blocks too).
* Both dtypes: bfloat16 (AVX512-BF16) and float32 (AVX-512, or AVX2 with FMA).
"""

from __future__ import annotations

import copy
import os
import statistics

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model import decode_tiles
from kvmosaic.model.attention import AttentionMetadata, DecodeBatch
from kvmosaic.model.fused_decode import AMX_MAX_ROWS, FusedDecode
from kvmosaic.model.packed_linear import amx_gemms
from tests.conftest import assert_greedy_within, make_llm, record_logits
from tests.test_batch_composition import BF16_LOGIT_TOL

# Both paths sum the projections in float32, in another order (oneDNN's blocking; AVX512-BF16 pair
# products here), and the difference compounds through 30 layers and the KV each step writes.
# Measured on the shipped model, 8 streams x 40 greedy steps: max logit difference median 0.31,
# largest 1.09 (logits near 20-27, bfloat16 ulp 0.125); each path's distance to transformers'
# float32 on the same tokens: median 0.32 both, largest 0.94 layer by layer, 0.81 fused.
# In float32 (FMA sums in another order than MKL's, the LM head in C too): largest 7.7e-5,
# median 3.4e-5, greedy tokens all equal over the same 8 x 40 steps.
FUSED_LOGIT_TOL = {"bfloat16": 1.25, "float32": 2e-4}


def _fused_llm(dtype: str = "bfloat16", **kwargs):
    llm = make_llm(dtype=dtype, **kwargs)
    if FusedDecode.for_model(llm.engine.model) is None:
        pytest.skip(f"no fused decode step on this CPU in {dtype} (needs AVX-512 or AVX2 with FMA; AVX512-BF16 for bfloat16)")
    return llm


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["Write a story about a river that", "Explain why the sky is blue, in detail, for a child of",
             "List seven colours of stone:"]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _count_fused_steps(model, monkeypatch) -> list[int]:
    """Wrap the model's fused step (built on first use) to count the steps it served."""
    served = [0]

    def count(fused, *args):
        out = fused.step(*args)
        served[0] += out is not None
        return out

    _around_fused_steps(model, monkeypatch, count)
    return served


class _Around:
    """A fused step whose ``step`` (what the model calls) runs ``around`` instead."""

    def __init__(self, fused: FusedDecode, around) -> None:
        self.fused, self.around = fused, around

    def step(self, x, positions, kv, meta, logits_index):
        return self.around(self.fused, x, positions, kv, meta, logits_index)


def _around_fused_steps(model, monkeypatch, around) -> None:
    """Run ``around(fused, x, positions, kv, meta, logits_index)`` (returning the step's logits) in
    place of every fused step the model takes."""
    decide = model.fused_decode

    def wrapped(kv, meta):
        fused = decide(kv, meta)
        return None if fused is None else _Around(fused, around)

    monkeypatch.setattr(model, "fused_decode", wrapped)  # the model is shared by the tests' engines


def _greedy(llm, prompts, max_tokens=20):
    logits = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs], [logits[o.request_id] for o in outs]


def _distance_to_reference(hf_model, prompts, tokens, logits, steps) -> list[float]:
    """Per step, the largest logit difference to transformers' float32 on the same tokens."""
    out = []
    for prompt, toks, log, n in zip(prompts, tokens, logits, steps):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 :]
        out += [(log[s].float() - ref[s]).abs().max().item() for s in range(n)]
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_greedy_matches_layer_by_layer_and_is_as_close_to_float32(dtype, monkeypatch, hf_model):
    llm = _fused_llm(dtype, num_kv_blocks=256)
    prompts = _prompts(llm.tokenizer)
    served = _count_fused_steps(llm.engine.model, monkeypatch)
    fused_tokens, fused_logits = _greedy(llm, prompts)
    assert served[0] >= 15, "the fused step served the decode steps"
    llm.reset_prefix_cache()
    monkeypatch.setattr(llm.engine.model, "fused_decode", lambda kv, meta: None)  # the layer-by-layer path
    layer_tokens, layer_logits = _greedy(llm, prompts)
    assert_greedy_within(FUSED_LOGIT_TOL[dtype], layer_tokens, fused_tokens, layer_logits, fused_logits)
    if dtype == "float32":
        assert fused_tokens == layer_tokens
    llm.engine.pool.check_invariants()

    # Neither is the truth: each is as far from transformers' float32 as the other.
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
             for a, b in zip(layer_tokens, fused_tokens)]
    layer = _distance_to_reference(hf_model, prompts, layer_tokens, layer_logits, agree)
    fused = _distance_to_reference(hf_model, prompts, fused_tokens, fused_logits, agree)
    floor = 0.0 if dtype == "bfloat16" else 1e-4  # float32: both at summation-order noise
    assert statistics.median(fused) <= 1.15 * statistics.median(layer) + floor
    assert max(fused) <= 1.25 * max(layer) + floor


@pytest.mark.parametrize("dtype, quantization, shared", [("bfloat16", None, False), ("float32", None, False),
                                                         ("float32", "gguf", False), ("bfloat16", "gguf", False),
                                                         ("bfloat16", None, True)])
def test_a_row_alone_equals_the_row_in_a_batch_bit_for_bit(dtype, quantization, shared, monkeypatch):
    """``shared``: the rows' contexts share a cached prefix of over two 128-key chunks, which the step attends
    once for all of them where it runs on AMX tiles (paged_decode_share): each row's bits as alone all the same."""
    llm = _fused_llm(dtype, num_kv_blocks=128, quantization=quantization)
    checked = []

    def check_rows(fused, x, positions, kv, meta, logits_index):
        batched = fused(x, positions, kv, meta)
        # a GGUF's Q8_0 head (float32) runs after the step; oneDNN's packed head (where it runs on AMX tiles)
        # is read by the step where the step reads rows
        assert (fused.head is not None) == ((quantization is None or dtype == "bfloat16")
                                            and (not amx_gemms(fused.dtype) or not decode_tiles.interleave()))
        logits = fused.step(x, positions, kv, meta, logits_index)  # the head in the same call, where it is fused
        assert torch.equal(logits, fused.logits(batched)), "the fused head gave other logits than the head after it"
        d = meta.decode
        for row in range(x.shape[0]):
            n = int(d.lens[row])
            alone = AttentionMetadata(meta.slot_mapping[row : row + 1], decode=DecodeBatch(
                torch.zeros(1, dtype=torch.long), d.ctx_slots[row : row + 1, :n], None, lens=d.lens[row : row + 1]))
            one = fused(x[row : row + 1], positions[row : row + 1], kv, alone)
            assert torch.equal(one[0], batched[row]), f"row {row} of {x.shape[0]} changed alone"
            assert torch.equal(fused.step(x[row : row + 1], positions[row : row + 1], kv, alone, None)[0], logits[row]), \
                "its logits changed alone"
        checked.append(x.shape[0])
        return logits

    _around_fused_steps(llm.engine.model, monkeypatch, check_rows)
    prompts = _prompts(llm.tokenizer)
    if shared:
        head = llm.tokenizer.encode("You are a careful assistant for a tile shop. " * 30, add_special_tokens=False)
        assert len(head) > 2 * 128
        prompts = [head + p for p in prompts]
    llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 9, 12)])
    assert checked and max(checked) == 3


def test_past_head_max_rows_the_models_head_runs_after_the_step(monkeypatch):
    """Where the step computes the head (``FusedDecode.head``) up to ``head_max_rows`` rows (on an AMX
    Xeon, oneDNN's packed head after the step is faster past 4): within the cap the logits are the
    step's head's, past it the model's own head's after the step, bit for bit either way."""
    llm = _fused_llm("bfloat16", num_kv_blocks=128)
    seen = []

    def capped(fused, x, positions, kv, meta, logits_index):
        if fused.head is None:
            pytest.skip("the step computes no head here")
        monkeypatch.setattr(fused, "head_max_rows", 2)
        logits = fused.step(x, positions, kv, meta, logits_index)
        hidden = fused(x, positions, kv, meta)
        assert torch.equal(logits, fused.logits(hidden))
        if x.shape[0] > 2:
            assert torch.equal(logits, fused.model.compute_logits(hidden))
        seen.append(x.shape[0])
        return logits

    _around_fused_steps(llm.engine.model, monkeypatch, capped)
    llm.generate(_prompts(llm.tokenizer), [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 8)])
    assert 3 in seen and 1 in seen


def _served_any(llm, monkeypatch) -> bool:
    served = _count_fused_steps(llm.engine.model, monkeypatch)
    llm.generate(_prompts(llm.tokenizer)[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return served[0] > 0


def test_declines_what_it_does_not_compute(monkeypatch):
    _fused_llm()  # skips where the fused step does not exist at all
    llm = make_llm(dtype="bfloat16", quantization="int8")
    assert FusedDecode.for_model(llm.engine.model) is None
    assert not _served_any(llm, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_q4_1_weights_are_fused_and_match_the_layer_path(dtype, monkeypatch):
    """The fused step on a GGUF's Q4_1 blocks, with the layer path's kernels' sums (kernels/q4_1_avx2.h in
    float32, q4_1_bf16.h in bfloat16: every projection the same bits there): greedy tokens and logits within the
    step's tolerance of the layer path's (float32: tokens equal; the head and, in bfloat16, attention and norms
    sum in another order); a row alone is the same bits as in its batch (test above). In bfloat16 the layer path
    multiplies weights rounded to bfloat16 past ``GEMV_MAX_ROWS`` rows, so the step declines past them."""
    from kvmosaic.model.quant_gguf import GEMV_MAX_ROWS

    llm = _fused_llm(dtype, quantization="gguf", num_kv_blocks=256)
    fused = FusedDecode.for_model(llm.engine.model)
    assert fused is not None and fused.max_rows == (GEMV_MAX_ROWS if dtype == "bfloat16" else None)
    prompts = _prompts(llm.tokenizer)
    served = _count_fused_steps(llm.engine.model, monkeypatch)
    fused_tokens, fused_logits = _greedy(llm, prompts)
    assert served[0] >= 15
    llm.reset_prefix_cache()
    monkeypatch.setattr(llm.engine.model, "fused_decode", lambda kv, meta: None)
    layer_tokens, layer_logits = _greedy(llm, prompts)
    if dtype == "float32":
        assert fused_tokens == layer_tokens
    assert_greedy_within(FUSED_LOGIT_TOL[dtype], layer_tokens, fused_tokens, layer_logits, fused_logits)


def test_turned_off_by_the_environment(monkeypatch):
    _fused_llm()
    monkeypatch.setenv("KVMOSAIC_FUSED_DECODE", "0")
    llm = make_llm(dtype="bfloat16")
    monkeypatch.setattr(llm.engine.model, "_fused", False)  # decided again (the model is shared, see above)
    assert not _served_any(llm, monkeypatch)


def test_steps_with_prefills_or_cascade_groups_run_layer_by_layer(monkeypatch):
    llm = _fused_llm(num_kv_blocks=256)
    model = llm.engine.model
    seen: list[tuple[bool, bool, bool]] = []  # per step: served fused, had prefills, had cascade groups
    decide = model.fused_decode

    def record(kv, meta):
        fused = decide(kv, meta)
        seen.append((fused is not None, bool(meta.prefills), bool(meta.decode and meta.decode.shared)))
        return fused

    monkeypatch.setattr(model, "fused_decode", record)
    monkeypatch.setattr(llm.engine.runner, "cascade", True)  # off by default where the C kernels serve
    shared = llm.tokenizer.encode("A long shared system prompt. " * 30, add_special_tokens=False)
    prompts = [shared + p for p in _prompts(llm.tokenizer)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # cache the shared prefix
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert any(cascade for _, _, cascade in seen), "the workload had steps with cascade groups"
    assert any(prefills for _, prefills, _ in seen)
    assert not any(served and (prefills or cascade) for served, prefills, cascade in seen)


def test_follows_the_pool_it_is_given_when_another_pool_shares_its_first_address(monkeypatch):
    """The model (and its fused step) is shared by a process's engines, so a new engine's pool can
    begin where a freed one began, with its other layers elsewhere (another size). The step must
    read and write the pool of this call: a cache keyed on the first layer's address alone wrote
    the new token's K/V into the freed pool's layers (a CI run: one cache-on request decoded a
    repeated token after a correct first one)."""
    llm = _fused_llm("float32", num_kv_blocks=64)
    checked = []

    def check_pools(fused, x, positions, kv, meta, logits_index):
        other = copy.copy(kv)  # layer 0 the same tensors, the others copies at other addresses
        other.k = kv.k[:1] + [t.clone() for t in kv.k[1:]]
        other.v = kv.v[:1] + [t.clone() for t in kv.v[1:]]
        out = fused(x, positions, kv, meta)
        again = fused(x, positions, other, meta)
        slots = meta.slot_mapping
        for layer in range(1, len(kv.k)):
            assert torch.equal(other.k[layer][slots], kv.k[layer][slots]), f"layer {layer}'s K went elsewhere"
            assert torch.equal(other.v[layer][slots], kv.v[layer][slots]), f"layer {layer}'s V went elsewhere"
        assert torch.equal(out, again)
        checked.append(x.shape[0])
        return fused.step(x, positions, kv, meta, logits_index)

    _around_fused_steps(llm.engine.model, monkeypatch, check_pools)
    llm.generate(_prompts(llm.tokenizer)[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert checked


def test_phase_timers_build_gives_the_same_steps_and_counts_their_phases(monkeypatch, tmp_path):
    """benchmarks/decode_phases.py's library (the same sources with KVMOSAIC_PHASE_TIMERS): the
    same greedy tokens and logits bit for bit, and every phase's seconds counted; the default
    library has no timers."""
    import ctypes
    import shutil

    from kvmosaic.model import kernels

    llm = _fused_llm()
    prompts = _prompts(llm.tokenizer)
    want = _greedy(llm, prompts, max_tokens=6)
    monkeypatch.setenv("KVMOSAIC_KERNEL_CACHE", str(tmp_path))
    # the timers beside whatever the run's library was built with (KVMOSAIC_NO_AMX: the vector kernels)
    monkeypatch.setenv("KVMOSAIC_KERNEL_DEFINES", f"{os.environ.get('KVMOSAIC_KERNEL_DEFINES', '')} KVMOSAIC_PHASE_TIMERS".strip())
    timed = kernels._declared(ctypes.CDLL(str(kernels._build(os.environ.get("CC") or shutil.which("cc")))))
    assert not hasattr(kernels.decode_step_library(), "decode_phase_seconds")
    seconds = (ctypes.c_double * 6).in_dll(timed, "decode_phase_seconds")
    monkeypatch.setattr(kernels, "decode_step_library", lambda: timed)
    got = _greedy(llm, prompts, max_tokens=6)
    assert got[0] == want[0]
    assert all(torch.equal(x, y) for a, b in zip(got[1], want[1]) for x, y in zip(a, b, strict=True))
    fused = FusedDecode.for_model(llm.engine.model)
    assert all(seconds[i] > 0 for i in range(6 if fused.head is not None else 5))  # 5: the final norm and head


def test_decode_batches_past_max_rows_take_the_layers(monkeypatch):
    """Where oneDNN's bfloat16 GEMMs run on AMX tiles the fused step serves at most AMX_MAX_ROWS decodes
    (larger batches are faster through the layers); elsewhere any batch. With a cap of 3, the steps that
    hold a fourth, short stream run the layers, the rest the fused step, and the three streams' greedy
    tokens are the uncapped run's within the bfloat16 tolerance (the layers sum in another order)."""
    llm = _fused_llm("bfloat16", num_kv_blocks=128)
    fused = FusedDecode.for_model(llm.engine.model)
    assert fused.max_rows == (AMX_MAX_ROWS if amx_gemms(torch.bfloat16) and fused.layout != decode_tiles.AMX
                              else None)
    prompts = _prompts(llm.tokenizer)
    want = _greedy(llm, prompts, max_tokens=8)
    fused.max_rows = 3
    monkeypatch.setattr(llm.engine.model, "_fused", fused)  # the model is shared by the tests' engines
    sizes = []

    def capped(fused, x, positions, kv, meta, logits_index):
        sizes.append(x.shape[0])
        return fused.step(x, positions, kv, meta, logits_index)

    _around_fused_steps(llm.engine.model, monkeypatch, capped)
    logits = record_logits(llm)
    outs = llm.generate(prompts + [prompts[0]], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                 for n in (8, 8, 8, 3)])
    assert sizes and max(sizes) == 3 and len(sizes) < 7  # the steps with four decodes ran the layers
    assert_greedy_within(BF16_LOGIT_TOL, want[0], [o.token_ids for o in outs[:3]], want[1],
                         [logits[o.request_id] for o in outs[:3]])
