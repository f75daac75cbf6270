"""The transformer, its weights and its tokenizer."""

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .loader import LoadedWeights, load_weights, shipped_model_path

__all__ = ["ModelConfig", "LlamaForCausalLM", "LoadedWeights", "load_weights", "shipped_model_path", "build_model"]


def build_model(weights: LoadedWeights, dtype: torch.dtype, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(weights.config)
    model = model.to_empty(device=device)
    model.rotary.__init__(weights.config.head_dim, weights.config.rope_theta, weights.config.max_position_embeddings)
    model.rotary.to(device)
    model.load_hf_tensors(weights.tensors)
    model.to(dtype)
    model.rotary.float()  # RoPE tables stay float32, as in transformers
    return model.eval()
