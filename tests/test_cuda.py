"""The engine on a CUDA device (skipped where there is none: CI's machines have no GPU).

The CPU suites run on a GPU too with ``KVMOSAIC_TEST_DEVICE=cuda`` (tests/conftest.py's
``make_llm``); this file holds what only a GPU can show, on the shipped GGUF's weights:

* the paged model on CUDA against transformers' Llama on CUDA (float32: TF32 off, as torch's
  default; all-position logits through a shuffled block table, then greedy generation);
* the engine on CUDA against itself on the CPU (float32 logits within ``CROSS_DEVICE_TOL``);
* invariant 1 in bfloat16 on CUDA, both prefix caches: greedy tokens equal with the cache on and
  off, logits within one bfloat16 rounding of the logit's size (cuBLAS picks its kernels by the
  row count, so a prefix hit's shorter prefill may sum in another order);
* a prefix offloaded from the CUDA pool to the host tier and loaded back (block_io's pinned
  copies) gives the no-cache outputs;
* the GGUF's own Q4_1 blocks (``quantization="gguf"``) on CUDA: the layer path's dequantized
  weights, the same greedy tokens as on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.model import load_model_bundle
from kvmosaic.model.attention import AttentionMetadata, PrefillSpan
from tests.conftest import make_llm, record_logits
from tests.test_cache_equivalence import random_workload, run
from tests.test_model_vs_transformers import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
CROSS_DEVICE_TOL = 2e-3  # float32 logits, std ~3: cuBLAS and oneDNN sum in other orders
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def hf_cuda(hf_model):
    """conftest's transformers Llama on the shipped GGUF's weights, a float32 copy on the GPU."""
    return copy.deepcopy(hf_model).to(CUDA).eval()


def test_paged_logits_on_cuda_match_transformers_on_cuda(hf_cuda, tokenizer):
    bundle = load_model_bundle(None, "float32", "cuda")
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        n, block = len(ids), 16
        blocks = -(-n // block) + 3
        kv = PagedKVCache(bundle.config, blocks, block, torch.float32, device=CUDA)
        table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))
        slots = (table[:, None] * block + torch.arange(block)).reshape(-1)[:n].to(CUDA)
        meta = AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)])
        ours = bundle.model(torch.tensor(ids, device=CUDA), torch.arange(n, device=CUDA), kv, meta, None)
        assert ours.device.type == "cuda"
        with torch.no_grad():
            ref = hf_cuda(torch.tensor([ids], device=CUDA)).logits[0].float()
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-3, f"{prompt!r}: max logit difference {diff}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_on_cuda_matches_transformers_on_cuda(hf_cuda, tokenizer):
    llm = make_llm(device="cuda")
    assert llm.engine.device.type == "cuda"
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf_cuda.generate(torch.tensor([ids], device=CUDA), max_new_tokens=12, do_sample=False,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=CUDA))
        assert out.token_ids == ref[0, len(ids):].tolist(), prompt


def test_cuda_engine_agrees_with_cpu_engine(tokenizer):
    prompts = random_workload(tokenizer, seed=3)
    cpu_outs, cpu_logits = run(make_llm(device="cpu"), prompts, 6, batched=True)
    cuda_outs, cuda_logits = run(make_llm(device="cuda"), prompts, 6, batched=True)
    worst = 0.0
    for a, b, la, lb in zip(cpu_outs, cuda_outs, cpu_logits, cuda_logits):
        assert a.token_ids == b.token_ids
        worst = max(worst, max((x - y).abs().max().item() for x, y in zip(la, lb)))
    print(f"cuda vs cpu, float32: max abs logit difference {worst:.2e}")
    assert worst < CROSS_DEVICE_TOL


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_bfloat16_cache_on_equals_cache_off_on_cuda(backend, tokenizer):
    prompts = random_workload(tokenizer, seed=5)
    off_outs, off_logits = run(make_llm(device="cuda", dtype="bfloat16", prefix_cache="none"), prompts, 8, True)
    llm = make_llm(device="cuda", dtype="bfloat16", prefix_cache=backend)
    on_outs, on_logits = run(llm, prompts, 8, True)
    assert sum(o.num_cached_tokens for o in on_outs) > 0, "no prefix hit: the test shows nothing"
    worst = 0.0
    for off, on, lo, ln in zip(off_outs, on_outs, off_logits, on_logits):
        assert off.token_ids == on.token_ids
        for a, b in zip(lo, ln):
            worst = max(worst, ((a - b).abs() / (a.abs() + 1.0)).max().item())
    print(f"bfloat16 on cuda, {backend}: max relative logit difference, cache on vs off {worst:.2e}")
    assert worst <= 2 ** -6  # two bfloat16 roundings of the logit


def test_host_tier_round_trip_from_the_cuda_pool(tokenizer):
    prompts = random_workload(tokenizer, seed=11, n=6)
    reference = make_llm(device="cuda", prefix_cache="none").generate(prompts, GREEDY)
    llm = make_llm(device="cuda", num_kv_blocks=12, kv_tiers=["host:64MiB"])
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    again = [llm.generate([p], GREEDY)[0] for p in prompts]  # the pool of 12 blocks evicted them
    loaded = sum(o.num_cached_tokens for o in again)
    assert loaded > 0, "nothing came back from the host tier"
    for ref, a, b in zip(reference, first, again):
        assert a.token_ids == ref.token_ids and b.token_ids == ref.token_ids
        for got, want in zip(b.logprobs, ref.logprobs):
            for tok in want:
                assert abs(got[tok] - want[tok]) <= 1e-4


def test_gguf_q4_1_weights_on_cuda_match_the_cpu(tokenizer):
    outs = {}
    for device in ("cpu", "cuda"):
        llm = make_llm(device=device, quantization="gguf")
        outs[device] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outs["cuda"] == outs["cpu"]


def test_logits_recorded_on_cuda_are_the_samplers(tokenizer):
    """record_logits (the suites' window into the runner) holds CPU copies of CUDA logits."""
    llm = make_llm(device="cuda")
    seen = record_logits(llm)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    steps = seen[out.request_id]
    assert len(steps) == 3 and all(s.device.type == "cpu" for s in steps)
    assert [int(s.argmax()) for s in steps] == out.token_ids
