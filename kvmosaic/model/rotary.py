"""Rotary position embeddings: the float32 cos/sin tables (``RotaryEmbedding``) and their rows at
one step's positions, applied to q and k (``RopeAt``), as transformers' Llama rotates them."""

from __future__ import annotations

import torch
from torch import nn

from . import kernels
from .families import Rope
from .rope_scaling import inv_freq as rope_inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables in float32 for every position up to ``max_positions``. The sin table is
    stored with the first half negated, so that :func:`apply_rope` rotates with one ``roll``.
    Past ``MAX_TABLE`` positions (128k-context models: a table would take hundreds of MB) the
    step's rows are computed from the frequencies instead, by the same float32 products.
    Tables span the rotating dimensions only (``rope_scaling.rotary_dim``: all but for partial
    rotary) and carry yarn's and longrope's ``attention_factor`` (transformers multiplies cos and
    sin by it)."""

    MAX_TABLE = 32768

    def __init__(self, head_dim: int, theta: float | Rope, max_positions: int) -> None:
        super().__init__()
        rope = theta if isinstance(theta, Rope) else Rope(float(theta))
        self.attention_factor = rope.attention_factor
        self.tabled = max_positions <= self.MAX_TABLE
        # computed on the CPU (and moved by .to) even when the model is built on the meta device,
        # where a first arange costs ~1 s (torch loads its symbolic shapes); build_model recomputes them
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(rope, head_dim, max_positions)
            half = inv_freq.numel()
            sign = torch.cat((-torch.ones(half), torch.ones(half)))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.register_buffer("sign", sign, persistent=False)
            cos, signed_sin = self._rows(torch.arange(max_positions if self.tabled else 0))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = (positions.to(torch.float32)[:, None] * self.inv_freq[None, :]).repeat(1, 2)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor * self.sign
        return emb.cos(), emb.sin() * self.sign

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at ``positions``, float32 ``[T, D]``."""
        return (self.cos[positions], self.signed_sin[positions]) if self.tabled else self._rows(positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rows(positions)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RopeAt:
    """The rotary tables at one step's positions (float32 ``[T, D]``), applied to q and k."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.cos, self.signed_sin = cos, signed_sin

    @classmethod
    def at(cls, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeAt:
        return cls(*rotary.rows(positions))

    def select(self, index: torch.Tensor) -> RopeAt:
        return RopeAt(self.cos[index], self.signed_sin[index])

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]``; in place where the kernel runs (heads contiguous).
        With partial rotary (tables narrower than D) the first dimensions rotate, the rest pass."""
        rd = self.cos.shape[-1]
        if rd != x.shape[-1]:
            rot = apply_rope(x[..., :rd], self.cos.to(x.dtype)[:, None, :], self.signed_sin.to(x.dtype)[:, None, :])
            return torch.cat((rot, x[..., rd:]), dim=-1)
        if kernels.elementwise_available(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return kernels.rope_(x, self.cos, self.signed_sin)
        return apply_rope(x, self.cos.to(x.dtype)[:, None, :], self.signed_sin.to(x.dtype)[:, None, :])

    def apply_and_store_(self, qkv: torch.Tensor, heads: int, kv_heads: int, k_pool: torch.Tensor,
                         v_pool: torch.Tensor, slots: torch.Tensor) -> bool:
        """Rotate the q and k heads of the fused QKV rows ``qkv`` in place and write each token's
        rotated k and its v to ``slots`` of the pools, in one pass (``kernels.rope_store``); False,
        with nothing done, where that kernel does not serve (then :meth:`apply_` and the pool's
        ``write``: the same values)."""
        return (self.cos.shape[-1] * (heads + 2 * kv_heads) == qkv.shape[-1] and kernels.elementwise_available(qkv)
                and kernels.rope_store(qkv, heads, kv_heads, self.cos, self.signed_sin, slots, k_pool, v_pool))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as in transformers, bit for bit: transformers'
    ``rotate_half(x)`` is ``cat(-x2, x1)``, which is ``roll(x, D/2)`` with the first half's sign moved
    into the table."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
