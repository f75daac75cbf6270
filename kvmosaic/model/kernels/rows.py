"""The row kernels of ``elementwise.c`` (RMSNorm with the residual add, RoPE and the KV write, SiLU·up):
one pass each over a step's rows, rounded where torch rounds; see this package's docstring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _library


def elementwise_available(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` and :func:`rope_` serve tensors like ``x``."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and _library() is not None


def _rows(t: torch.Tensor) -> bool:
    """A 2-D view whose rows are contiguous (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[rows, hidden]`` times ``weight`` (same dtype), as Hugging
    Face's Llama computes it. With ``residual``, normalizes ``x + residual`` and writes that sum
    into ``residual`` (in place: the residual stream the next sublayer adds to)."""
    rows, hidden = x.shape
    if not (_rows(x) and weight.is_contiguous() and weight.dtype == x.dtype and hidden <= 8192
            and (residual is None or (_rows(residual) and residual.dtype == x.dtype))):
        raise ValueError("rms_norm: unsupported layout")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _library().rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(), hidden,
                        rows, hidden, eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, dim]`` (heads contiguous, any token stride) in place by the
    float32 tables ``[tokens, dim]`` (see ``model/llama.py``'s ``RotaryEmbedding``). Returns ``x``."""
    tokens, heads, dim = x.shape
    if not (x.stride(2) == 1 and x.stride(1) == dim and dim <= 512 and cos.dtype == torch.float32
            and cos.is_contiguous() and signed_sin.is_contiguous()):
        raise ValueError("rope_: unsupported layout")
    _library().rope_store(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), tokens, heads, 0, dim,
                          None, None, None, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return x


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
               slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """:func:`rope_` on the q and k heads of the fused QKV projection's rows ``qkv`` ``[tokens, (heads
    + 2 kv_heads) dim]`` (in place), and the rotated k and the v of token ``t`` written to row
    ``slots[t]`` of the pools ``[num_slots, kv_heads, dim]``, in one pass. False (nothing done) where
    the layout or dtypes are not the kernel's."""
    dim = cos.shape[-1] if cos.dim() == 2 else 0
    if not (_rows(qkv) and dim and qkv.shape[1] == (heads + 2 * kv_heads) * dim and dim <= 512
            and cos.dtype == signed_sin.dtype == torch.float32 and cos.is_contiguous() and signed_sin.is_contiguous()
            and k_pool.dtype == v_pool.dtype == qkv.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.shape[1:] == v_pool.shape[1:] == (kv_heads, dim) and slots.dtype == torch.int64
            and slots.is_contiguous() and slots.numel() == qkv.shape[0] == cos.shape[0]):
        return False
    _library().rope_store(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), qkv.shape[0], heads,
                          kv_heads, dim, slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                          int(qkv.dtype == torch.bfloat16), torch.get_num_threads())
    return True


@dataclass(frozen=True)
class PoolRows:
    """The addresses of every layer's K and V pool (``[num_slots, kv_heads, dim]``, contiguous, on
    the CPU), for :func:`rerotate_store`; from :func:`pool_rows`. Valid while those pools live
    (a ``PagedKVCache``'s never move)."""
    k: torch.Tensor  # [layers] int64
    v: torch.Tensor
    dtype: torch.dtype
    row: tuple[int, int]  # (kv_heads, dim)
    num_slots: int  # the smallest pool's


def pool_rows(k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> PoolRows | None:
    """``k_pools`` / ``v_pools`` as :func:`rerotate_store` takes them, or None where it cannot."""
    pools = (*k_pools, *v_pools)
    first = pools[0]
    if not (first.dtype in (torch.float32, torch.bfloat16) and first.dim() == 3 and first.shape[2] <= 512
            and all(p.dtype == first.dtype and p.device.type == "cpu" and p.is_contiguous()
                    and p.shape[1:] == first.shape[1:] for p in pools)
            and _library() is not None):
        return None
    return PoolRows(torch.tensor([p.data_ptr() for p in k_pools], dtype=torch.int64),
                    torch.tensor([p.data_ptr() for p in v_pools], dtype=torch.int64), first.dtype,
                    tuple(first.shape[1:]), min(p.shape[0] for p in pools))


def rerotate_store(kv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                   pools: PoolRows) -> bool:
    """A stored segment's KV ``kv`` ``[layers, 2, tokens, kv_heads, dim]`` (each layer's K and V rows
    contiguous, any layer stride) written to row ``slots[t]`` of each layer's pools, K moved by one
    shift: ``k * cos + roll(k, rot / 2) * signed_sin`` over its first ``rot`` dims (float32 tables
    ``[rot]``) in float32, rounded once (``blend/rope.py``'s :func:`~kvmosaic.blend.rope.rerotate`,
    bit for bit). False (nothing done) where the layout or dtypes are not the kernel's."""
    layers, two, tokens, kv_heads, dim = kv.shape
    rot, row = cos.numel(), kv_heads * dim
    if not (two == 2 and kv.dtype == pools.dtype and kv.device.type == "cpu" and (kv_heads, dim) == pools.row
            and layers == pools.k.numel() and kv.stride(4) == 1 and kv.stride(3) == dim and kv.stride(2) == row
            and kv.stride(1) % row == 0 and 0 < rot <= dim and rot % 2 == 0 and signed_sin.numel() == rot
            and cos.dtype == signed_sin.dtype == torch.float32 and cos.is_contiguous() and signed_sin.is_contiguous()
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
            and (not tokens or 0 <= int(slots.min()) <= int(slots.max()) < pools.num_slots)):
        return False
    _library().rerotate_store(kv.data_ptr(), kv.stride(0), kv.stride(1), layers, tokens, kv_heads, dim, rot,
                              cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(), pools.k.data_ptr(),
                              pools.v.data_ptr(), int(kv.dtype == torch.bfloat16), torch.get_num_threads())
    return True


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` ``[rows, 2 * inter]`` (gate, then up: the fused projection's
    output, rows contiguous), rounded as torch rounds ``F.silu(gate) * up``; SiLU's exp is the
    kernels' own (``elementwise.h``), so a bfloat16 result can differ from torch's in rare ties."""
    rows, width = x.shape
    if not (_rows(x) and width % 2 == 0):
        raise ValueError("silu_mul: unsupported layout")
    out = x.new_empty(rows, width // 2)
    _library().silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, width // 2, int(x.dtype == torch.bfloat16),
                        torch.get_num_threads())
    return out
