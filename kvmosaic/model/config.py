"""The shape of a decoder, read from a GGUF header or a config.json; how its family departs
from Llama is its :class:`~.families.Traits`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import Traits, rope_of, text_config, traits_from_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    traits: Traits = Traits()

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        traits = traits_from_hf(cfg)  # refuses what the decoder does not implement
        cfg = text_config(cfg)  # a multimodal checkpoint's language model
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=rope_of(cfg, "full_attention" if traits.family == "gemma3_text" else None).theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            traits=traits,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
