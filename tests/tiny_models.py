"""Tiny checkpoints of each supported family, built and saved by transformers itself.

Each is made from a config (2-3 layers, hidden 64, vocabulary 272) with fixed-seed random
weights — every parameter drawn, biases and norm weights included, so that a switch left off
(a bias, a ``1 + w`` norm) changes the logits — saved as safetensors next to a byte-level
tokenizer (256 byte tokens + 16 specials). Nothing is downloaded.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

VOCAB = 272
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False)

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.15 * i for i in range(6)], "long_factor": [1.5 + 0.9 * i for i in range(6)]}

# family -> (transformers config class name, overrides). Windows of 32 tokens (2 blocks of 16)
# so that the tests' ~100-token prompts run past them.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters={  # Llama 3.1's scaling, its ramp inside 16 dims
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-yarn": ("Qwen2Config", dict(max_position_embeddings=256, rope_parameters={  # Qwen2.5's long context
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=32)),
    "phi3": ("Phi3Config", dict(sliding_window=40)),
    "phi3-partial": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    # Phi-4-mini's RoPE: longrope (the prompts run past the original 64 positions: long factors)
    # over the first 3/4 of each head
    "phi4-longrope": ("Phi3Config", dict(partial_rotary_factor=0.75, original_max_position_embeddings=64,
                                         rope_parameters=LONGROPE)),
    "gemma2": ("Gemma2Config", dict(sliding_window=32, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                    attn_logit_softcapping=8.0, final_logit_softcapping=6.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=24,
                                        tie_word_embeddings=True,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0}})),
    # Gemma 3 with a vision tower (4B and up): its language model loads, text in and out; a
    # 128k context, so RoPE rows are computed per step rather than tabled
    "gemma3-vision": ("Gemma3Config", dict(sliding_window=24, query_pre_attn_scalar=24, sliding_window_pattern=2,
                                           max_position_embeddings=131072)),
}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


def hf_config(family: str, spec: tuple[str, dict] | None = None):
    import transformers

    cls_name, overrides = spec or FAMILIES[family]
    if cls_name == "Gemma3Config":  # multimodal: the text model's config inside
        return transformers.Gemma3Config(text_config={**COMMON, **overrides}, vision_config=VISION,
                                         mm_tokens_per_image=4, boi_token_index=269, eoi_token_index=270,
                                         image_token_index=271)
    return getattr(transformers, cls_name)(**{**COMMON, **overrides})


def save_tokenizer(path: Path) -> None:
    """A byte-level BPE without merges: each byte one token (ids 0-255), then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<bos>", "<eos>", "<pad>"] + [f"<extra_{i}>" for i in range(VOCAB - 259)]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": specials[3:]})
    fast.save_pretrained(str(path))


def build(family: str, path: Path, seed: int = 0, spec: tuple[str, dict] | None = None):
    """Save the family's tiny model (and tokenizer) to ``path``; return transformers' model, in
    float32 eval mode, as loaded back from that folder. ``spec``: (config class, overrides)
    instead of the family's row of ``FAMILIES``."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(family, spec), dtype=torch.float32)
        gemma = family.startswith("gemma")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if "norm" in name:  # Gemma's norms scale by 1 + w, the others by w
                    p.copy_((0.0 if gemma else 1.0) + 0.3 * noise)
                else:
                    p.copy_(0.15 * noise)
        model.save_pretrained(str(path))
        save_tokenizer(path)
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
