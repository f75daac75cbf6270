"""The row kernels of ``elementwise.c`` (RMSNorm with the residual add, RoPE and the KV write, SiLU·up):
one pass each over a step's rows, rounded where torch rounds; see this package's docstring."""

from __future__ import annotations

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
