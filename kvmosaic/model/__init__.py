"""The transformer, its weights and its tokenizer."""

import functools
from dataclasses import dataclass

import torch

from .config import DTYPES, ModelConfig
from .llama import LlamaForCausalLM
from .loader import LoadedWeights, load_weights, shipped_model_path
from .packed_linear import packing_supported
from .quant import QUANTIZATIONS, quantize_int8, quantized_fingerprint
from .quant_gguf import quantize_gguf, require_q4_1
from .tokenizer import load_tokenizer, stop_token_ids

__all__ = [
    "ModelConfig", "LlamaForCausalLM", "LoadedWeights", "ModelBundle",
    "load_weights", "shipped_model_path", "build_model", "load_model_bundle", "QUANTIZATIONS",
]


def build_model(weights: LoadedWeights, dtype: torch.dtype, device: str | torch.device = "cpu",
                quantization: str | None = None) -> LlamaForCausalLM:
    """The model in ``dtype`` on ``device``; ``quantization="int8"`` stores its projections and
    LM head as int8 weights (model/quant.py), ``"gguf"`` computes them on the file's Q4_1 blocks
    (model/quant_gguf.py: ``weights`` loaded with ``keep_q4_1``), the rest being pre-packed
    where CPU bfloat16 is."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if quantization == "gguf":
        require_q4_1(weights)  # refuses before building
    with torch.device("meta"):
        model = LlamaForCausalLM(weights.config)
    _materialize(model, device)
    model.load_hf_tensors(weights.tensors)
    model.to(dtype)
    model.reset_rotary(device)  # RoPE tables stay float32, as in transformers
    if quantization == "int8":
        quantize_int8(model)
    elif packing_supported(dtype, torch.device(device)):
        model.pack_linears()
    if quantization == "gguf":
        quantize_gguf(model, weights)
    return model.eval()


def _materialize(model: torch.nn.Module, device: str | torch.device) -> None:
    """Uninitialised storage on ``device`` for every meta parameter and buffer: what
    ``Module.to_empty`` does, without its detour through torch's reference ops, whose first use
    imports symbolic shapes and sympy (~0.4 s of every start). The weights are loaded over it."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


@dataclass(frozen=True)
class ModelBundle:
    """A built model with its tokenizer and identity. The model is only read at inference,
    so engines in one process share it (each engine has its own KV pool)."""

    model: LlamaForCausalLM
    tokenizer: object
    config: ModelConfig
    fingerprint: str  # of the weights as computed with: quantization included
    name: str
    stop_token_ids: tuple[int, ...] = ()  # EOS and the model's other end-of-generation ids


def load_model_bundle(model: str | None, dtype: str, device: str, quantization: str | None = None,
                      max_model_len: int | None = None) -> ModelBundle:
    """The model (shared by the engines of a process that ask for the same one). ``max_model_len``:
    the context an engine serves; it matters only to longrope, whose factor set follows it
    (families.Rope), and then the engine gets a model of its own with those RoPE tables."""
    bundle = _load_model_bundle(model, dtype, device, quantization, None)
    cfg = bundle.config
    if max_model_len is None or max_model_len >= cfg.max_position_embeddings or \
            not any(r.kind == "longrope" for r in bundle.model.ropes):
        return bundle
    return _load_model_bundle(model, dtype, device, quantization, max_model_len)


@functools.lru_cache(maxsize=2)
def _load_model_bundle(model: str | None, dtype: str, device: str, quantization: str | None,
                       rope_positions: int | None) -> ModelBundle:
    weights = load_weights(model, keep_q4_1=quantization == "gguf")
    built = build_model(weights, DTYPES[dtype], device, quantization)
    if rope_positions is not None:
        built.reset_rotary(device, rope_positions)
    tokenizer = load_tokenizer(weights.tokenizer_dir, weights.gguf_file)
    fingerprint = quantized_fingerprint(weights.fingerprint, quantization)
    stops = stop_token_ids(tokenizer, None if weights.gguf_file else weights.tokenizer_dir) + weights.stop_token_ids
    return ModelBundle(built, tokenizer, weights.config, fingerprint, weights.name, stops)
