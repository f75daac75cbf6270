"""The architectures that load, and where each departs from Llama: one table of switches.

Every family runs the same decoder (``model/llama.py``). What differs is read once from the
checkpoint's config into a frozen :class:`Traits` (per layer where it varies: sliding window,
RoPE base) and the decoder consults it:

========== ======= ======= ===================== ========= ============= =====================
family     qkv     q/k     norms                 MLP       scores        windows
========== ======= ======= ===================== ========= ============= =====================
llama      -       -       RMSNorm, pre          SwiGLU    1/sqrt(d)     none
mistral    -       -       RMSNorm, pre          SwiGLU    1/sqrt(d)     every layer, if set
qwen2      bias    -       RMSNorm, pre          SwiGLU    1/sqrt(d)     layers >= max_window_layers, if use_sliding_window
qwen3      -       RMSNorm RMSNorm, pre          SwiGLU    1/sqrt(d)     as qwen2
phi3       fused   -       RMSNorm, pre          SwiGLU    1/sqrt(d)     every layer, if set
gemma2     -       -       (1+w), pre and post   GeGLU     qpas, capped  layer_types (1 local : 1 global)
gemma3     -       (1+w)   (1+w), pre and post   GeGLU     qpas          layer_types (5 : 1), local RoPE base
========== ======= ======= ===================== ========= ============= =====================

(``gemma3``, the multimodal checkpoint, loads its language model: ``text_config``, text in and
out.) RoPE may be scaled ``linear``, ``llama3``, ``yarn`` or ``longrope`` (:class:`Rope`), per layer
type for Gemma 3, and rotate only the first ``partial_rotary_factor`` of each head (Phi-4-mini).

(``qpas``: ``query_pre_attn_scalar ** -0.5``; Gemma also scales embeddings by sqrt(hidden), and
Gemma 2 caps final logits.) A window ``W`` means the query at position ``p`` sees keys at
``p - W < j <= p``, as transformers' ``sliding_window_overlay``. Anything the table cannot
express (other RoPE scalings, biases elsewhere, bidirectional attention, a vision
tower's input: images) is refused by :func:`traits_from_hf` with a one-line ``ValueError`` naming the reason,
before any weight is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Rope:
    """One RoPE table's parameters: the base, and a scaling transformers names ``linear``
    (every frequency divided by ``factor``: Gemma 3's global layers), ``llama3`` (low
    frequencies divided, high kept, a smooth ramp between: Llama 3.1+), ``yarn`` (the same idea
    with YaRN's ramp over ``beta_fast`` / ``beta_slow`` rotations, and cos/sin scaled by
    ``attention_factor``: Qwen2.5/3 long context) or ``longrope`` (per-frequency divisors,
    ``short_factor`` or ``long_factor``, and ``attention_factor``: Phi-3/3.5/4 long context), or
    llama.cpp's per-frequency divisors (``freq_factors``, a GGUF's ``rope_freqs`` tensor).
    ``partial``: the fraction of each head's dimensions that rotate (the rest pass through).

    longrope picks its factor set by sequence length in transformers (``long`` past
    ``original_max_positions``) and recomputes nothing it cached; a paged cache shared by
    requests must rotate a token the same way whatever comes later, so kvmosaic picks one set
    per engine: ``long`` when the context it serves (``--max-model-len``) passes
    ``original_max_positions``, else ``short`` — transformers' own choice for every sequence
    that stays within (short), or whose prompt already passes, the original length (long).
    """

    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    freq_factors: tuple[float, ...] = ()
    partial: float = 1.0
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class Traits:
    """How one model departs from Llama. The defaults are Llama: a ``Traits()`` changes nothing."""

    family: str = "llama"
    qkv_bias: bool = False  # Qwen2: biases on q, k and v (not o)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    gemma_norms: bool = False  # (1 + w) RMSNorm in float32; a norm after attention and after the MLP
    activation: str = "silu"  # the gate's: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    windows: tuple[int | None, ...] = ()  # per layer; () when no layer has one
    ropes: tuple[Rope, ...] = ()  # per layer; () when every layer has default RoPE at ModelConfig.rope_theta

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope(self, layer: int, theta: float) -> Rope:
        return self.ropes[layer] if self.ropes else Rope(theta)

    @property
    def segment_reuse_ok(self) -> bool:
        """Segment reuse (blend/) runs the plain decoder step by step; it has no windows, caps,
        embedding scale or per-layer RoPE bases."""
        return not (self.windows or len(set(self.ropes)) > 1 or self.attn_softcap or self.embed_scale
                    or any(r.kind in ("yarn", "longrope") or r.partial != 1.0 for r in self.ropes))


ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")


def _rope(params: dict, theta: float, where: str, cfg: dict | None = None) -> Rope:
    """A RoPE from a ``rope_parameters`` / ``rope_scaling`` dict (``cfg``: the whole config, for
    the fields older files keep at its top level); unknown scalings are refused."""
    cfg = cfg or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"{where}: RoPE type {kind!r} is not supported yet; supported: {', '.join(ROPE_KINDS)}")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return Rope(theta, partial=partial)
    if kind == "linear":
        return Rope(theta, kind, float(params["factor"]), partial=partial)
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    if kind == "llama3":
        return Rope(theta, kind, float(params["factor"]), float(params["low_freq_factor"]),
                    float(params["high_freq_factor"]), original, partial=partial)
    from .rope_scaling import scaled_rope  # yarn and longrope: their factor and attention factor

    return scaled_rope(kind, theta, params, original, cfg.get("max_position_embeddings", original), partial)


def rope_of(cfg: dict, layer_type: str | None = None) -> Rope:
    """The RoPE of the config (of one layer type where the config has one per type), from
    ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling`` (older files)."""
    where = cfg.get("model_type", "config")
    default = 1_000_000.0 if (where, layer_type) == ("gemma3_text", "full_attention") else 10000.0
    theta = float(cfg.get("rope_theta", default))
    if layer_type == "sliding_attention":
        theta = float(cfg.get("rope_local_base_freq", 10000.0))
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif layer_type != "sliding_attention" and cfg.get("rope_scaling"):
        params = {**params, **cfg["rope_scaling"]}  # older files: Gemma 3 scales its global layers only
    return _rope(params, theta, where, cfg)


def _layer_types(cfg: dict, n: int, default: Callable[[int], bool]) -> list[bool]:
    """Which layers slide: ``layer_types`` when the config lists them, else ``default(i)``."""
    types = cfg.get("layer_types")
    if types:
        if len(types) < n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"{cfg.get('model_type')}: layer_types {types!r} not understood")
        return [t == "sliding_attention" for t in types[:n]]
    return [default(i) for i in range(n)]


def _sliding_layers(cfg: dict, family: str, n: int) -> list[bool]:
    """Which layers are local (``sliding_attention``) by the family's rule."""
    if family in ("qwen2", "qwen3"):
        return _layer_types(cfg, n, lambda i: i >= cfg.get("max_window_layers", 28))
    if family in ("mistral", "phi3"):
        return [True] * n  # transformers applies the window to every layer (layer_types ignored)
    if family == "gemma2":
        return _layer_types(cfg, n, lambda i: (i + 1) % 2 != 0)
    if family == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        return _layer_types(cfg, n, lambda i: (i + 1) % pattern != 0)
    return [False] * n


def _windows(cfg: dict, family: str, slides: list[bool]) -> tuple[int | None, ...]:
    w = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        w = None
    windows = tuple(int(w) if (w and s) else None for s in slides)
    return windows if any(windows) else ()


# Multimodal checkpoints whose language model loads alone (text in, text out): model_type ->
# the text model's type, and the prefixes its tensors carry in the file
TEXT_TOWERS = {"gemma3": ("gemma3_text", ("language_model.model.", "model.language_model."))}


def text_config(cfg: dict) -> dict:
    """The language model's config of a multimodal checkpoint (``TEXT_TOWERS``), else ``cfg``.
    Published files list only what differs from the defaults there (gemma-3-4b-it: six keys), so
    the rest is filled in by transformers' own config class."""
    if cfg.get("model_type") not in TEXT_TOWERS or "text_config" not in cfg:
        return cfg
    from transformers import AutoConfig

    model_type = TEXT_TOWERS[cfg["model_type"]][0]
    given = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    given.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    text = AutoConfig.for_model(model_type, **given).to_dict()
    text["model_type"] = model_type
    return text


def traits_from_hf(cfg: dict) -> Traits:
    """Read a Hugging Face ``config.json`` (as a dict) into :class:`Traits`; refuse what the
    decoder does not implement, in one line naming the supported architectures. A multimodal
    checkpoint's language model is read (``text_config``); its vision tower is not."""
    cfg = text_config(cfg)
    family = cfg.get("model_type") or "llama"
    if family not in SUPPORTED:
        raise ValueError(f"architecture {family!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if cfg.get("mlp_bias") or (cfg.get("attention_bias") and family != "qwen2"):
        raise ValueError(f"{family}: attention_bias / mlp_bias checkpoints are not supported yet")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{family}: bidirectional attention (an embedding model) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"{family}: activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    n = cfg["num_hidden_layers"]
    slides = _sliding_layers(cfg, family, n)
    windows = _windows(cfg, family, slides)
    gemma = family.startswith("gemma")
    if family == "gemma3_text":
        local, full = rope_of(cfg, "sliding_attention"), rope_of(cfg, "full_attention")
        ropes = tuple(local if s else full for s in slides)
    else:
        rope = rope_of(cfg)
        ropes = () if rope == Rope(rope.theta) else (rope,) * n
    return Traits(
        family=family,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "gemma3_text"),
        gemma_norms=gemma,
        activation=act,
        embed_scale=float(cfg["hidden_size"]) ** 0.5 if gemma else None,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=cfg.get("attn_logit_softcapping") if family == "gemma2" else None,
        final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        windows=windows,
        ropes=ropes,
    )


def check_model(model: str | None) -> Traits | None:
    """Refuse a model path that does not exist or an architecture that would not load, reading
    only its config (``config.json`` or the GGUF header): called when the engine's options are
    checked, before anything is allocated. Returns the traits of a ``config.json`` model (None
    for a GGUF file or the shipped model, ``model=None``)."""
    if model is None:
        return None
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist (nothing is downloaded)")  # hub.resolve_model first
    if path.is_dir() and (path / "config.json").exists():
        return traits_from_hf(json.loads((path / "config.json").read_text()))
    if path.is_file() and path.suffix == ".gguf":
        from .gguf_arch import check_gguf_arch
        from .gguf_index import gguf_index

        check_gguf_arch(gguf_index(path).fields.get("general.architecture"))
        return None
    raise ValueError(f"{model}: expected a .gguf file or a folder with config.json and *.safetensors")
