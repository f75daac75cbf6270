"""RoPE inverse frequencies for a :class:`~.families.Rope`: default, ``linear`` and ``llama3``
as transformers computes them (``modeling_rope_utils``), and llama.cpp's per-frequency divisors."""

from __future__ import annotations

import math

import torch

from .families import Rope


def inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies."""
    freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
