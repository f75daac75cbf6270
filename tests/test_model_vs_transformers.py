"""The model against transformers' Llama on the same GGUF weights (float32)."""

from __future__ import annotations

import torch

from kvmosaic import SamplingParams
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.model import load_model_bundle
from kvmosaic.model.attention import AttentionMetadata, PrefillSpan
from tests.conftest import make_llm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nName three colors of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, two astronauts walked on the surface of the Moon for the first time. Their names were",
]


def paged_logits(token_ids: list[int], block_size: int = 16, seed: int = 0) -> torch.Tensor:
    """All-position logits through the paged pool, with a shuffled block table so that
    reading through the table (not contiguity) is what makes it right."""
    bundle = load_model_bundle(None, "float32", "cpu")
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 3
    kv = PagedKVCache(bundle.config, num_blocks, block_size, torch.float32)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
    meta = AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)])
    return bundle.model(torch.tensor(token_ids), torch.arange(n), kv, meta, None)


def test_logits_match_transformers(hf_model, tokenizer):
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        ours = paged_logits(ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-3, f"{prompt!r}: max logit difference {diff}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_tokens_match_transformers(hf_model, tokenizer):
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.token_ids == ref[0, len(ids):].tolist(), prompt
