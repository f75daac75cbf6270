"""Write a tiny transformers model as a GGUF file the way llama.cpp's converter lays it out
(header keys, tensor names, Q/K rows permuted for ``llama`` files only), float32 tensors.
Used to check kvmosaic's GGUF reader against transformers (and its own GGUF reader)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: interleave each head's two RoPE halves."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter for Llama 3.1+: one divisor per frequency (1 for high frequencies,
    ``factor`` for low ones, a smooth ramp between)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_model, arch: str, path: Path) -> Path:
    import gguf

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    gemma = arch.startswith("gemma")
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(rope, c.head_dim))
    for name, t in hf_model.state_dict().items():
        a = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma converter folds the 1 of (1 + w) into the weight
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            g = f"blk.{idx}.{(GEMMA_NORMS if gemma and module in GEMMA_NORMS else HF_TO_GGUF)[module]}.{suffix}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads
                a = _permute(a, heads)
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
