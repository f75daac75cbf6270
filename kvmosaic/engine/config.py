"""Engine configuration, as one small dataclass (names follow vLLM's engine arguments)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import DTYPES
from ..model.quant import QUANTIZATIONS

PREFIX_CACHES = ("hash", "radix", "none")


def auto_dtype(device: torch.device) -> str:
    """bfloat16 where the hardware computes it natively (CUDA; CPUs with AVX512-BF16 or AMX),
    float32 elsewhere: on an AVX2-only CPU bfloat16 takes slow emulated paths (measured 5x
    slower prefill than float32 on an AMD EPYC, BENCHMARKS.md)."""
    if device.type == "cuda":
        return "bfloat16"
    if device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return "bfloat16"
    return "float32"


@dataclass
class EngineConfig:
    model: str | None = None  # None: the shipped SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # "auto" | "bfloat16" | "float32" | "float16"; see auto_dtype
    device: str = "auto"  # "auto" takes CUDA when there is one
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Decodes sharing a cached prefix attend it once (model/attention.py); False: each reads it.
    cascade_attention: bool = True
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    prefix_cache: str | None = None  # "hash" | "radix" | "none"; None follows enable_prefix_caching
    hash_algo: str = "sha256"  # see cache/hashing.py: "sha256" | "sha256_cbor" | "xxh3_128"
    verify_tokens: bool = False  # compare tokens on every hash hit (guards against collisions)
    scheduling_policy: str = "fcfs"  # or "lpm"
    eviction_policy: str = "lru"
    enable_kv_events: bool = False
    num_threads: int | None = None
    # Weight-only quantization (model/quant.py): None, or "int8" (per-channel int8 projections and
    # LM head; faster decode on CPU, outputs within a measured tolerance of the float model).
    quantization: str | None = None
    # Segment reuse (issue 6): "off" | "shift" (re-position only) | "blend" (+ selective recompute)
    segment_reuse: str = "off"
    blend_ratio: float = 0.15  # fraction of reused segment tokens recomputed
    blend_threshold: float | None = None  # if set: recompute tokens deviating more (overrides ratio)
    blend_check_layer: int = 2  # the early layer whose KV deviation picks tokens (>= 1)
    segment_cache_memory: int = 256 << 20  # bytes for stored segment KV (LRU)
    # When set, a text prompt is cut at each occurrence (which is dropped): the first piece is
    # the head, the last the suffix, those between are segments (e.g. "<|segment|>").
    segment_separator: str | None = None
    # Storage tiers below the pool, fastest first (kvmosaic/tiers/spec.py), e.g.
    # ["host:4GiB", "disk:/var/cache/kvmosaic:20GiB", "redis://127.0.0.1:6379"]; None: pool only.
    kv_tiers: list[str] | None = None
    kv_tier_load_timeout: float = 2.0  # seconds; a load past it is a miss (the tokens are computed)

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            self.dtype = auto_dtype(self.torch_device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.prefix_cache is None:
            self.prefix_cache = "hash" if self.enable_prefix_caching else "none"
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        self.enable_prefix_caching = self.prefix_cache != "none"
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}")
        from ..blend.blender import BlendOptions  # validates the segment reuse fields

        BlendOptions(self.segment_reuse, self.blend_ratio, self.blend_threshold, self.blend_check_layer)
        if self.kv_tiers:
            from ..tiers.spec import parse_tier_spec

            self.kv_tiers = list(self.kv_tiers)
            for spec in self.kv_tiers:
                parse_tier_spec(spec)  # raises ValueError on a bad spec
        if self.segment_separator is not None and not self.segment_separator.strip():
            raise ValueError("segment_separator must be a non-blank string")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
