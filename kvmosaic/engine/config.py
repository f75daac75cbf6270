"""Engine configuration: the options of :class:`~.arg_utils.EngineArgs`, validated where the engine runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..model.config import DTYPES
from ..model.families import check_model
from ..model.hub import resolve_model
from ..model.quant import QUANTIZATIONS
from .arg_utils import PREFIX_CACHES, SCHEDULING_POLICIES, USAGE_CONTEXTS, EngineArgs
from .pace import SERVING_STALL_MS


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
class EngineConfig(EngineArgs):
    """An :class:`~.arg_utils.EngineArgs` validated, with the machine's choices made
    (``dtype="auto"``, ``prefix_cache=None``); its fields are declared there, once."""

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
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {self.usage_context!r}")
        if self.max_decode_stall_ms is None:
            self.max_decode_stall_ms = SERVING_STALL_MS if self.usage_context == "server" else 0.0
        if self.max_decode_stall_ms < 0:
            raise ValueError(f"max_decode_stall_ms must be >= 0, got {self.max_decode_stall_ms}")
        if min(self.fair_share_chunk_tokens, self.fair_share_decode_rows, self.fair_share_anticipation_ms) < 0:
            raise ValueError("fair_share_chunk_tokens, fair_share_decode_rows and fair_share_anticipation_ms "
                             f"must be >= 0, got {self.fair_share_chunk_tokens}, {self.fair_share_decode_rows} "
                             f"and {self.fair_share_anticipation_ms}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        from ..blend.blender import BlendOptions  # validates the segment reuse fields
        from ..blend.shadow import MAX_AUDIT_TOKENS

        BlendOptions(self.segment_reuse, self.blend_ratio, self.blend_threshold, self.blend_check_layer,
                     self.blend_selection or "deviation", head=self.blend_head_tokens)
        if not self.auto_reuse_max_drift >= 0:
            raise ValueError(f"auto_reuse_max_drift must be non-negative, got {self.auto_reuse_max_drift}")
        if self.auto_reuse_contexts < 1:
            raise ValueError(f"auto_reuse_contexts must be at least 1, got {self.auto_reuse_contexts}")
        if not 0.0 <= self.auto_reuse_audit_rate <= 1.0:  # NaN fails too
            raise ValueError(f"auto_reuse_audit_rate must be in [0, 1], got {self.auto_reuse_audit_rate}")
        if not 1 <= self.auto_reuse_audit_tokens <= MAX_AUDIT_TOKENS:
            raise ValueError(f"auto_reuse_audit_tokens must be in [1, {MAX_AUDIT_TOKENS}], "
                             f"got {self.auto_reuse_audit_tokens}")
        if self.auto_reuse_audit_bound is not None and not self.auto_reuse_audit_bound >= 0:
            raise ValueError(f"auto_reuse_audit_bound must be non-negative, got {self.auto_reuse_audit_bound}")
        if self.auto_reuse_audit_trip is not None and not 0.0 <= self.auto_reuse_audit_trip < 1.0:
            raise ValueError(f"auto_reuse_audit_trip must be in [0, 1), got {self.auto_reuse_audit_trip}")
        if self.kv_tiers:
            from ..tiers.spec import parse_tier_spec

            self.kv_tiers = list(self.kv_tiers)
            for spec in self.kv_tiers:
                parse_tier_spec(spec)  # raises ValueError on a bad spec
        if not 0.0 <= self.kv_cache_metrics_sample <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample is a fraction in [0, 1], got {self.kv_cache_metrics_sample}")
        if self.segment_separator is not None and not self.segment_separator.strip():
            raise ValueError("segment_separator must be a non-blank string")
        from ..model.tokenizer import SHIPPED_TEMPLATES, resolve_chat_template

        self.chat_template = resolve_chat_template(self.chat_template)
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat template file {self.chat_template!r} does not exist (shipped templates: "
                             f"{', '.join(SHIPPED_TEMPLATES)})")
        self.model = resolve_model(self.model)  # org/name: its folder in the local HF cache
        traits = check_model(self.model)  # its architecture, from its config alone
        if traits is not None and self.segment_reuse != "off" and not traits.segment_reuse_ok:
            raise ValueError(f"segment reuse is not supported for {traits.family} models "
                             "(sliding windows, capped scores or scaled embeddings)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
