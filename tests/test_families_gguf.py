"""GGUF files of the families llama.cpp names (llama, qwen2, qwen3, phi3, gemma2, gemma3;
Llama 3.1's RoPE scaling as a ``rope_freqs`` tensor): kvmosaic's reader against transformers,
float32 prefill logits at every position.

The file is written from a tiny transformers model in llama.cpp's layout (tests/tiny_gguf.py).
Where transformers' own GGUF reader loads it (llama, qwen2, gemma2, gemma3), kvmosaic must match
that model too:
the layout conventions (names, Q/K permutation) are then checked by code nobody here wrote.
(transformers 5.23 reads no head_dim for qwen3 and breaks on phi3's pad id in GGUF.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.model import build_model, load_weights
from kvmosaic.model.attention import AttentionMetadata, PrefillSpan
from tests.tiny_gguf import write_gguf
from tests.tiny_models import build

TOL = 1e-4
HF_READS_IT = {"llama", "qwen2", "gemma2", "gemma3"}


def logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    weights = load_weights(path)
    model = build_model(weights, torch.float32)
    n = ids.numel()
    kv = PagedKVCache(weights.config, -(-n // 16), 16, torch.float32)
    slots = torch.arange(n)
    return model(ids, torch.arange(n), kv, AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)]))


# Gemma as llama.cpp's header leaves it to code: query_pre_attn_scalar = head_dim (256 here, also
# transformers' GGUF default), Gemma 3's five local layers in six and local RoPE base 10000
GEMMA = {
    "gemma2": ("Gemma2Config", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=24,
                                    tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=24, num_hidden_layers=7,
                                        tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1)),
}


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_gguf_logits_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = build(family, tmp_path, spec=GEMMA.get(family))
    gguf_file = write_gguf(hf, "llama" if family.startswith("llama") else family, tmp_path / "model.gguf")
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(3))
    ours = logits(str(gguf_file), ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < TOL
    if family in HF_READS_IT:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_file.name,
                                                             dtype=torch.float32).eval()
        with torch.no_grad():
            ref = from_gguf(ids[None]).logits[0]
        assert (ours - ref).abs().max().item() < TOL


def test_gguf_refuses_other_architectures(tmp_path):
    import gguf

    from kvmosaic.engine.config import EngineConfig

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2"):
        EngineConfig(model=str(tmp_path / "m.gguf"))
