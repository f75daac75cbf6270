"""The transformer, its weights and its tokenizer."""

import functools
from dataclasses import dataclass

import torch

from .config import DTYPES, ModelConfig
from .llama import LlamaForCausalLM
from .loader import LoadedWeights, load_weights, shipped_model_path
from .packed_linear import packing_supported
from .tokenizer import load_tokenizer

__all__ = [
    "ModelConfig", "LlamaForCausalLM", "LoadedWeights", "ModelBundle",
    "load_weights", "shipped_model_path", "build_model", "load_model_bundle",
]


def build_model(weights: LoadedWeights, dtype: torch.dtype, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(weights.config)
    model = model.to_empty(device=device)
    model.rotary.__init__(weights.config.head_dim, weights.config.rope_theta, weights.config.max_position_embeddings)
    model.rotary.to(device)
    model.load_hf_tensors(weights.tensors)
    model.to(dtype)
    model.rotary.float()  # RoPE tables stay float32, as in transformers
    if packing_supported(dtype, torch.device(device)):
        model.pack_linears()
    return model.eval()


@dataclass(frozen=True)
class ModelBundle:
    """A built model with its tokenizer and identity. The model is only read at inference,
    so engines in one process share it (each engine has its own KV pool)."""

    model: LlamaForCausalLM
    tokenizer: object
    config: ModelConfig
    fingerprint: str
    name: str


@functools.lru_cache(maxsize=2)
def load_model_bundle(model: str | None, dtype: str, device: str) -> ModelBundle:
    weights = load_weights(model)
    built = build_model(weights, DTYPES[dtype], device)
    tokenizer = load_tokenizer(weights.tokenizer_dir, weights.gguf_file)
    return ModelBundle(built, tokenizer, weights.config, weights.fingerprint, weights.name)
