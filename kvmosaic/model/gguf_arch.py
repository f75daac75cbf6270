"""How a GGUF file (llama.cpp's conventions) names what a Hugging Face checkpoint names.

The header becomes a ``config.json``-style dict, so a GGUF model is read into ``Traits`` by
the same table as a safetensors folder (``families.py``); tensor names map to Hugging Face's.
llama.cpp permutes Q/K rows for its own RoPE in ``llama`` files only (undone by the loader);
Phi-3 keeps q/k/v fused (``attn_qkv``) and gate/up fused (``ffn_up``, gate rows first).
Llama 3.1+ RoPE scaling is a ``rope_freqs`` tensor of per-frequency divisors.
Gemma: llama.cpp folds the ``+1`` of Gemma's norms into their weights (taken out again here),
names the norms around attention and MLP ``post_attention_norm`` / ``ffn_norm`` /
``post_ffw_norm``, and fixes in code what the header does not say, as read from llama.cpp:
local layers every other layer (Gemma 2) or five in six (Gemma 3, unless the header has a
``sliding_window_pattern``), a local RoPE base of 10000 (Gemma 3), and an attention scale of
``1/sqrt(head_dim)`` except for the 27B models (``1/sqrt(hidden / heads)``).
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig
from .families import Rope

# GGUF general.architecture -> Hugging Face model_type
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
              "gemma3": "gemma3_text"}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def check_gguf_arch(arch: str | None) -> str:
    """The Hugging Face model_type of a GGUF architecture, or a one-line refusal."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")
    return GGUF_ARCHS[arch]


def hf_config(fields: dict, has_output: bool) -> dict:
    """The header's fields as a ``config.json`` dict."""
    arch = fields.get("general.architecture")
    model_type = check_gguf_arch(arch)
    get = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    cfg = {
        "model_type": model_type,
        "vocab_size": int(get("vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    if get("rope.freq_base") is not None:
        cfg["rope_theta"] = float(get("rope.freq_base"))
    if get("rope.scaling.type") not in (None, "none", "linear"):
        raise ValueError(f"{arch}: RoPE scaling {get('rope.scaling.type')!r} from GGUF is not supported yet "
                         "(a safetensors folder with it loads)")
    if get("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": get("rope.scaling.type"), "factor": float(get("rope.scaling.factor", 1.0))}
    if arch in GEMMA_27B_LAYERS:
        big = cfg["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=hidden // heads if big else head_dim)
        if arch == "gemma2":
            cfg.update(attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
                       final_logit_softcapping=float(get("final_logit_softcapping", 30.0)))
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern:
            cfg["sliding_window_pattern"] = int(pattern)
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"{arch}: partial rotary ({rotary} of {head_dim} dimensions) from GGUF is not supported "
                         "yet (a safetensors folder with partial_rotary_factor loads)")
    if get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    return cfg


def hf_tensor_name(arch: str, name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not one the model reads)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or (parts[2] not in LAYER_NAMES and parts[2] not in GEMMA_NORMS):
        return None
    _, idx, kind, suffix = parts
    if arch in GEMMA_27B_LAYERS and kind in GEMMA_NORMS:
        hf = GEMMA_NORMS[kind]
    else:
        hf = "mlp.gate_up_proj" if (arch, kind) == ("phi3", "ffn_up") else LAYER_NAMES[kind]
    return f"model.layers.{idx}.{hf}.{suffix}"


def unfold_norm(arch: str, hf_name: str, w):
    """Gemma's norm weights as Hugging Face stores them (llama.cpp stores ``1 + w``)."""
    return w - 1.0 if arch in GEMMA_27B_LAYERS and hf_name.endswith("norm.weight") else w


def with_freq_factors(cfg: ModelConfig, factors: list[float]) -> ModelConfig:
    """``cfg`` whose every layer divides its RoPE frequencies by ``factors`` (``rope_freqs``)."""
    if len(factors) != cfg.head_dim // 2:
        raise ValueError(f"rope_freqs has {len(factors)} factors, expected head_dim / 2 = {cfg.head_dim // 2}")
    rope = Rope(cfg.rope_theta, freq_factors=tuple(factors))
    return replace(cfg, traits=replace(cfg.traits, ropes=(rope,) * cfg.num_layers))
