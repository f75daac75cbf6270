"""Moving a cached K to another position.

RoPE rotates each pair of K's rotating dimensions by ``position * inv_freq``. Rotations compose,
so a K stored after rotation at position p moves to p + d by one more rotation of angle
``d * inv_freq``: ``R(p + d) k = R(d) R(p) k``. V carries no position and never moves.

The frequencies are the model's own (``RotaryEmbedding.inv_freq``: RoPE scaling — linear,
llama3, yarn, longrope — and a GGUF's ``rope_freqs`` included); with partial rotary only the
first ``2 * len(inv_freq)`` dimensions rotate and the rest stay. A scaling's attention factor
multiplied the stored K's rotated part once already and is not applied again. The angle is
formed in float64 so that large shifts lose no precision before cos/sin.
"""

from __future__ import annotations

import torch

from ..model.rotary import apply_rope


def shift_tables(delta: torch.Tensor | int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (``model/llama.py``'s convention: the first half of sin negated) of
    ``delta`` positions (an int, or ``[T]``), float32 ``[rotary_dim]`` or ``[T, rotary_dim]``."""
    d = torch.as_tensor(delta, dtype=torch.float64)
    freqs = d[..., None] * inv_freq.double().cpu()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = inv_freq.numel()
    sign = torch.cat((-torch.ones(half, dtype=torch.float64), torch.ones(half, dtype=torch.float64)))
    return emb.cos().float(), (emb.sin() * sign).float()


def rerotate(k: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``k`` ``[..., T, heads, head_dim]`` (already rotated at some positions) by
    ``delta`` positions (an int, or one per token ``[T]``), with the model's ``inv_freq``
    (``[rotary_dim / 2]``). Computed in float32, returned in ``k``'s dtype
    (``kernels.rerotate_store`` does the same in one pass, bit for bit)."""
    t, rot = k.shape[-3], 2 * inv_freq.numel()
    cos, signed_sin = shift_tables(torch.as_tensor(delta).expand(t), inv_freq)
    kf = k.float()
    moved = apply_rope(kf[..., :rot], cos.to(k.device)[:, None, :], signed_sin.to(k.device)[:, None, :])
    if rot < k.shape[-1]:
        moved = torch.cat((moved, kf[..., rot:]), dim=-1)
    return moved.to(k.dtype)
