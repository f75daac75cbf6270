"""What one prefill and one decode step of a model must compute and read, from its own files:
parameter counts and stored bytes from a GGUF header or a safetensors folder's headers (no
weights are loaded), attention shape from the GGUF metadata or config.json.

Guarantees: ``non_embedding_params`` counts every stored weight but the token embedding and the
LM head (the dense work each token does); ``lm_head_params`` is vocabulary x hidden whether tied
or not (a decode step reads it whole); ``stored_bytes`` are the bytes of those tensors as the
file stores them (a Q4_1 GGUF: its 4-bit blocks), which is what a server reading the file's own
format (llama.cpp) reads per step. Used by :mod:`.machine_share`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

EMBEDDING_NAMES = ("token_embd.weight", "embed_tokens.weight")
LM_HEAD_NAMES = ("output.weight", "lm_head.weight")


@dataclass(frozen=True)
class ModelSize:
    non_embedding_params: int
    lm_head_params: int
    stored_non_embedding_bytes: int  # in the file's own format
    stored_lm_head_bytes: int  # the output tensor's, or the tied embedding's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    file_format: str  # "GGUF Q4_1" (the most common tensor type) or "safetensors BF16"

    def prefill_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """2 x non-embedding params x new tokens (the LM head runs for the last token only: not
        counted) + causal attention: for each new token at position i and each query head,
        QK^T and AV over its i + 1 positions, 2 x head_dim FLOPs each."""
        n, c = new_tokens, cached_tokens
        pairs = n * c + n * (n + 1) / 2
        return 2.0 * self.non_embedding_params * n + 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs

    def decode_weight_bytes(self, bytes_per_weight: float | None) -> float:
        """Weight bytes one decode step reads at batch 1: every non-embedding weight and the LM
        head, at ``bytes_per_weight`` (the serving dtype), or as stored in the file when None."""
        if bytes_per_weight is None:
            return float(self.stored_non_embedding_bytes + self.stored_lm_head_bytes)
        return float(self.non_embedding_params + self.lm_head_params) * bytes_per_weight


def _matches(name: str, suffixes: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in suffixes)


def _size(tensors: list[tuple[str, int, int]], shape: tuple[int, int, int, int, int, int], fmt: str) -> ModelSize:
    """``tensors``: (name, elements, stored bytes); ``shape``: layers, heads, KV heads, head dim,
    hidden, FFN."""
    emb = [t for t in tensors if _matches(t[0], EMBEDDING_NAMES)]
    head = [t for t in tensors if _matches(t[0], LM_HEAD_NAMES)] or emb  # tied: the embedding is the head
    body = [t for t in tensors if not _matches(t[0], EMBEDDING_NAMES + LM_HEAD_NAMES)]
    return ModelSize(sum(t[1] for t in body), sum(t[1] for t in head), sum(t[2] for t in body), sum(t[2] for t in head),
                     *shape, fmt)


def gguf_size(path: Path) -> ModelSize:
    from collections import Counter

    from .gguf_header import read_header

    fields, infos = read_header(path)
    arch = fields["general.architecture"]

    def field(key: str, default=None):
        return fields.get(f"{arch}.{key}", default)

    heads, hidden = int(field("attention.head_count")), int(field("embedding_length"))
    head_dim = int(field("attention.key_length", 0) or field("rope.dimension_count", 0) or hidden // heads)
    tensors = [(t.name, t.n_elements, t.n_bytes) for t in infos]
    common = Counter(t.type_name for t in infos if len(t.shape) > 1).most_common(1)
    shape = (int(field("block_count")), heads, int(field("attention.head_count_kv", heads)), head_dim,
             hidden, int(field("feed_forward_length")))
    return _size(tensors, shape, f"GGUF {common[0][0] if common else '?'}")


def folder_size(path: Path) -> ModelSize:
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    tensors, dtypes = [], set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                dtype = sl.get_dtype()
                dtypes.add(dtype)
                tensors.append((name, n, n * {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}.get(dtype, 4)))
    shape = (int(cfg["num_hidden_layers"]), heads, int(cfg.get("num_key_value_heads", heads)), head_dim,
             int(cfg["hidden_size"]), int(cfg["intermediate_size"]))
    return _size(tensors, shape, f"safetensors {'/'.join(sorted(dtypes))}")


@functools.lru_cache(maxsize=4)
def model_size(model: str | None) -> ModelSize:
    """The size of ``--model`` (a GGUF file or a safetensors folder; None: the shipped GGUF)."""
    from ..model.loader import shipped_model_path

    path = Path(model or shipped_model_path())
    return gguf_size(path) if path.is_file() else folder_size(path)
