"""Moving a cached K to another position.

RoPE rotates each pair of K's dimensions by ``position * inv_freq``. Rotations compose, so a K
stored after rotation at position p moves to p + d by one more rotation of angle
``d * inv_freq``: ``R(p + d) k = R(d) R(p) k``. V carries no position and never moves.
The angle is formed in float64 so that large shifts lose no precision before cos/sin.
"""

from __future__ import annotations

import torch

from ..model.llama import rotate_half


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The per-pair frequencies, computed exactly as the model's rotary tables are."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rerotate(k: torch.Tensor, delta: torch.Tensor | int, head_dim: int, theta: float) -> torch.Tensor:
    """Rotate ``k`` ``[..., T, heads, head_dim]`` (already rotated at some positions) by
    ``delta`` positions (an int, or one per token ``[T]``). Computed in float32, returned in
    ``k``'s dtype."""
    t = k.shape[-3]
    d = torch.as_tensor(delta, dtype=torch.float64).expand(t)
    freqs = d[:, None] * inv_freq(head_dim, theta).double()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().float().to(k.device)[:, None, :]
    sin = emb.sin().float().to(k.device)[:, None, :]
    kf = k.float()
    return (kf * cos + rotate_half(kf) * sin).to(k.dtype)
