"""quantization="gguf" (model/quant_gguf.py, kernels/q4_1_matmul.c, q8_0_matmul.c): the file's own
Q4_1 blocks (and its Q8_0 LM head in float32), exactly the float model's weights; the kernels against
their torch references, batch invariant; the engine against the float model on the same weights;
its own cache identity; cache on == off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmosaic import SamplingParams
from kvmosaic.bench.quant import chat_prompts, quality
from kvmosaic.model import build_model, kernels
from kvmosaic.model.loader import LoadedWeights, load_weights, shipped_model_path
from kvmosaic.model.quant_gguf import GEMV_MAX_ROWS, Q4_1Linear, Q8_0Head
from tests.conftest import make_llm

needs_kernel = pytest.mark.skipif(not kernels.q4_1_available(), reason="no Q4_1 kernel here (no C compiler?)")


def random_blocks(out: int, inf: int, seed: int) -> torch.Tensor:
    """Q4_1 blocks with random nibbles and scales / minima of a real model's size."""
    g = torch.Generator().manual_seed(seed)
    nb = inf // kernels.Q4_1_BLOCK
    blocks = torch.randint(0, 256, (out, nb, kernels.Q4_1_BYTES), generator=g, dtype=torch.uint8)
    dm = torch.stack([torch.rand(out, nb, generator=g) * 0.01, -torch.rand(out, nb, generator=g) * 0.08], -1)
    blocks[..., 0:4] = dm.half().view(torch.uint8).reshape(out, nb, 4)
    return blocks.reshape(out, -1).contiguous()


def test_reference_dequantizes_as_gguf_py_does():
    """The torch reference (and so the kernel's check) is gguf-py's Q4_1 dequantization, bit for bit."""
    from gguf import GGMLQuantizationType, dequantize

    blocks = random_blocks(40, 256, seed=1)
    want = dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1).astype(np.float32)
    assert torch.equal(kernels.q4_1_reference(kernels.q4_1_split(blocks)), torch.from_numpy(want))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(dtype):
    split = kernels.q4_1_split(random_blocks(300, 576, seed=2))
    w = kernels.q4_1_reference(split)
    assert torch.equal(kernels.q4_1_dequantize(split, dtype), w.to(dtype))
    x = torch.randn(GEMV_MAX_ROWS, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = kernels.q4_1_matmul(split, x)
    want = (x.float() @ w.T).to(dtype)  # float32 accumulation of x * dequant(w), rounded to x's dtype
    assert got.dtype == dtype
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-5 * float(want.abs().max()))


@needs_kernel
def test_a_row_does_not_depend_on_the_other_rows():
    """Batch invariance: a row alone, in any batch, at any place, is bitwise the same."""
    split = kernels.q4_1_split(random_blocks(200, 1536, seed=4))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(5)).to(dtype)
        batch = kernels.q4_1_matmul(split, x)
        for i in range(13):
            assert torch.equal(kernels.q4_1_matmul(split, x[i : i + 1]), batch[i : i + 1])
        shuffled = torch.randperm(13, generator=torch.Generator().manual_seed(6))
        assert torch.equal(kernels.q4_1_matmul(split, x[shuffled]), batch[shuffled])


def test_both_paths_of_the_layer_agree():
    """Few rows (the kernel) and many (dequantized GEMM) compute the same product up to the
    compute dtype's rounding of the weights; the head variant returns float32."""
    blocks = random_blocks(96, 128, seed=7)
    layer, head = Q4_1Linear(blocks, 128), Q4_1Linear(blocks, 128, logits=True)
    x = torch.randn(GEMV_MAX_ROWS + 8, 128, generator=torch.Generator().manual_seed(8))
    many = layer(x)
    few = torch.cat([layer(x[i : i + 4]) for i in range(0, x.shape[0], 4)])
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.linear(x, kernels.q4_1_reference(kernels.q4_1_split(blocks))), many, rtol=1e-5, atol=1e-5)
    assert head(x.bfloat16()[:2]).dtype == torch.float32


def test_loader_keeps_the_blocks_in_the_float_rows_order():
    """The kept blocks (Q/K rows un-permuted for RoPE like the float rows) dequantize to exactly
    the float tensors the default path loads."""
    weights = load_weights(None, keep_q4_1=True)
    assert weights.formats["model.embed_tokens.weight"] == "Q8_0"  # the shipped head stays dequantized
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        blocks = weights.q4_1_blocks[name]
        assert torch.equal(kernels.q4_1_reference(kernels.q4_1_split(blocks)), weights.tensors[name])
    assert load_weights(None).q4_1_blocks is None  # the default path keeps nothing extra


def test_refuses_weights_without_q4_1_blocks():
    weights = load_weights(None)  # blocks not kept
    with pytest.raises(ValueError, match="without its Q4_1 blocks"):
        build_model(weights, torch.float32, "cpu", "gguf")
    folder = LoadedWeights(weights.config, weights.tensors, weights.tokenizer_dir, None, "f", "a-folder")
    with pytest.raises(ValueError, match="a-folder is not a GGUF file"):  # as a safetensors folder loads
        build_model(folder, torch.float32, "cpu", "gguf")
    no_q4 = LoadedWeights(weights.config, weights.tensors, weights.tokenizer_dir, "x.gguf", "f", "x",
                          q4_1_blocks={}, formats={"model.embed_tokens.weight": "Q8_0"})
    with pytest.raises(ValueError, match="needs Q4_1 blocks; x.gguf stores Q8_0"):
        build_model(no_q4, torch.float32, "cpu", "gguf")


def random_q8_0_blocks(out: int, inf: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nb = inf // kernels.Q4_1_BLOCK
    blocks = torch.randint(0, 256, (out, nb, kernels.Q8_0_BYTES), generator=g, dtype=torch.uint8)
    blocks[..., 0:2] = (torch.rand(out, nb, 1, generator=g) * 0.004).half().view(torch.uint8)
    return blocks.reshape(out, -1).contiguous()


def test_q8_0_reference_dequantizes_as_gguf_py_does():
    from gguf import GGMLQuantizationType, dequantize

    blocks = random_q8_0_blocks(40, 256, seed=6)
    want = dequantize(blocks.numpy(), GGMLQuantizationType.Q8_0).astype(np.float32)
    assert torch.equal(kernels.q8_0_reference(kernels.q8_0_split(blocks)), torch.from_numpy(want))


@pytest.mark.skipif(not kernels.q8_0_available(), reason="no Q8_0 kernel here (no C compiler?)")
def test_q8_0_kernel_matches_the_reference_and_a_row_does_not_depend_on_the_others():
    split = kernels.q8_0_split(random_q8_0_blocks(301, 576, seed=7))  # 301: a last tile of one channel
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(8))
    got, want = kernels.q8_0_matmul(split, x), x @ kernels.q8_0_reference(split).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for i in range(13):
        assert torch.equal(kernels.q8_0_matmul(split, x[i : i + 1])[0], got[i])
    assert torch.equal(kernels.q8_0_matmul(split, x[3:8]), got[3:8])


@pytest.fixture(scope="module")
def engines():
    return make_llm(), make_llm(quantization="gguf")


def test_gguf_has_its_own_cache_identity(engines):
    ref, q = engines
    assert q.engine.model_info.quantization == "gguf"
    assert q.engine.model_info.fingerprint != ref.engine.model_info.fingerprint
    assert q.engine.model_info.fingerprint.endswith("+gguf-weight-only")
    layer = q.engine.model.layers[0]
    assert isinstance(layer.qkv_proj, Q4_1Linear) and isinstance(layer.down_proj, Q4_1Linear)
    head = q.engine.model.head_proj  # the shipped head is Q8_0: on its blocks in float32 where the kernel is
    assert isinstance(head, Q8_0Head) == kernels.q8_0_available()
    if isinstance(head, Q8_0Head):
        assert head.dense.data_ptr() == q.engine.model.output_weight.data_ptr()  # shared, not a copy
    assert shipped_model_path().endswith("Q4_1.gguf")


def test_gguf_generates_the_float_models_greedy_text(engines):
    """In float32 the gguf model has exactly the float model's weights; only the summation
    order differs (kernel vs GEMM). Tolerance: logprobs within 1e-3 and the same greedy tokens
    wherever the float model's top two differ by more than that."""
    ref, q = engines
    prompts = chat_prompts(ref.tokenizer, 3, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    want = ref.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = q.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_same_decided_tokens(got, want, noise=1e-3, at_least=60)


def test_gguf_bfloat16_stays_close_to_the_default_path():
    """In bfloat16 the default path rounds the weights to 8 bits, gguf does not (the figures of
    `python -m kvmosaic.bench.quant`, BENCHMARKS.md): top-1 agreement and KL per token bounded."""
    ref, q = make_llm(dtype="bfloat16"), make_llm(dtype="bfloat16", quantization="gguf")
    got = quality(ref, q, chat_prompts(ref.tokenizer, 2, seed=0), max_tokens=24)
    assert got["teacher_forced_top1_agreement"] >= 0.9, got
    assert got["kl_mean"] < 0.01, got


def test_gguf_outputs_equal_with_the_cache_on_and_off():
    """A cached prefix (its suffix computed by the kernel or the GEMM, whichever its rows pick)
    gives what a full prefill gives, within float32 summation-order noise."""
    on, off = make_llm(quantization="gguf"), make_llm(quantization="gguf", prefix_cache="none")
    prompts = chat_prompts(on.tokenizer, 3, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    first = on.generate([{"prompt_token_ids": prompts[0]}], params)  # caches the system prompt
    got = first + on.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    want = off.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert sum(o.num_cached_tokens for o in got[1:]) > 0
    assert_same_decided_tokens(got, want, noise=1e-3, at_least=30)


def assert_same_decided_tokens(got, want, noise: float, at_least: int) -> None:
    compared = 0
    for g, w in zip(got, want):
        for lg, lw, tok, ref_tok in zip(g.logprobs, w.logprobs, g.token_ids, w.token_ids):
            top = sorted(lw.values(), reverse=True)
            if top[0] - top[1] < noise:
                break  # undecided in the reference: the runs may go different ways from here
            assert tok == ref_tok
            assert abs(lg[tok] - lw[tok]) < noise
            compared += 1
    assert compared >= at_least, f"only {compared} decided tokens compared"
