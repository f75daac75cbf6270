"""RoPE inverse frequencies for a :class:`~.families.Rope`: default, ``linear``, ``llama3``,
``yarn`` and ``longrope`` as transformers computes them (``modeling_rope_utils``: the same
float32 operations in the same order, so the tables agree bit for bit), llama.cpp's
per-frequency divisors, and partial rotary (only the first ``partial * head_dim`` dimensions
of a head rotate)."""

from __future__ import annotations

import math

import torch

from .families import Rope


def rotary_dim(rope: Rope, head_dim: int) -> int:
    """How many of a head's dimensions rotate (transformers: ``int(head_dim * partial)``)."""
    return int(head_dim * rope.partial)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def scaled_rope(kind: str, theta: float, params: dict, original: int, max_positions: int, partial: float) -> Rope:
    """A ``yarn`` or ``longrope`` :class:`Rope` from its parameters: ``factor`` defaults to
    ``max_positions / original``; ``attention_factor`` to YaRN's ``0.1 ln(factor) + 1`` (or the
    ratio of the two ``mscale`` terms DeepSeek-style configs give) and LongRoPE's
    ``sqrt(1 + ln(factor) / ln(original))``."""
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    att = params.get("attention_factor")
    if kind == "yarn":
        if att is None:
            mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
            att = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor)
        return Rope(theta, kind, factor, original_max_positions=original, partial=partial,
                    attention_factor=float(att), beta_fast=float(params.get("beta_fast") or 32),
                    beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return Rope(theta, kind, factor, original_max_positions=original, partial=partial, attention_factor=float(att),
                short_factor=tuple(map(float, params["short_factor"])),
                long_factor=tuple(map(float, params["long_factor"])))


def inv_freq(rope: Rope, head_dim: int, max_positions: int | None = None) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32 inverse frequencies. ``max_positions``: the context served,
    which picks longrope's factor set (see :class:`Rope`)."""
    dim = rotary_dim(rope, head_dim)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.kind == "yarn":
        return _yarn(rope, dim, exponent)
    if rope.kind == "longrope":
        long = max_positions is not None and max_positions > rope.original_max_positions
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"longrope: {ext.numel()} factors, expected rotary_dim / 2 = {dim // 2}")
        return 1.0 / (ext * rope.theta**exponent)
    freq = 1.0 / (rope.theta**exponent)
    if rope.freq_factors:
        freq = freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.kind == "linear":
        return freq / rope.factor
    if rope.kind == "llama3":
        # wavelengths past low_freq_wavelen are divided by factor, those under high_freq_wavelen
        # kept, and the ones between interpolated smoothly
        old = rope.original_max_positions
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / rope.low_freq_factor, freq / rope.factor, freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < old / rope.high_freq_factor) * ~(wavelen > old / rope.low_freq_factor)
        return torch.where(medium, smoothed, scaled)
    return freq


def _yarn(rope: Rope, dim: int, exponent: torch.Tensor) -> torch.Tensor:
    """YaRN: high frequencies (more than ``beta_fast`` rotations over the original context)
    kept, low ones (fewer than ``beta_slow``) divided by ``factor``, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = rope.theta**exponent
    extrapolation, interpolation = 1.0 / pos, 1.0 / (rope.factor * pos)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
