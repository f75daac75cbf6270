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

from ..model.llama import rotate_half


def rerotate(k: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``k`` ``[..., T, heads, head_dim]`` (already rotated at some positions) by
    ``delta`` positions (an int, or one per token ``[T]``), with the model's ``inv_freq``
    (``[rotary_dim / 2]``). Computed in float32, returned in ``k``'s dtype."""
    t, rot = k.shape[-3], 2 * inv_freq.numel()
    d = torch.as_tensor(delta, dtype=torch.float64).expand(t)
    freqs = d[:, None] * inv_freq.double().cpu()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().float().to(k.device)[:, None, :]
    sin = emb.sin().float().to(k.device)[:, None, :]
    kf = k.float()
    head = kf[..., :rot]
    moved = head * cos + rotate_half(head) * sin
    if rot < k.shape[-1]:
        moved = torch.cat((moved, kf[..., rot:]), dim=-1)
    return moved.to(k.dtype)
