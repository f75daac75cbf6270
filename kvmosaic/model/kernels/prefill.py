"""Causal prefill attention over the paged pool, in C: bfloat16 on AMX tiles where the CPU has them
(``prefill_attention_amx.c``) and else on AVX512-BF16, float32 on AVX-512 or AVX2 with FMA
(``prefill_attention.c``, ``prefill_attention_avx2.c``;
docs/ARCHITECTURE.md, "Prefill attention").

Serves a prompt span whose queries are the last tokens of its context with no mask beyond
causality (``PrefillSpan.mask is None``), or queries at any positions of it that each see the
context up to themselves (``PrefillSpan.positions``: the tokens a blend recomputes), queries and
pool in one of those dtypes, head dim 64 or 128. Checked
once against torch's attention in float32 (a disagreement turns it off, logged); elsewhere
``model/attention.py`` keeps torch's path. A row's result is the same bits whatever came from
the cache and whatever else the step holds (the kernel's invariants)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from . import _library

log = logging.getLogger("kvmosaic")

DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float32)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      scale: float, positions: torch.Tensor | None = None) -> torch.Tensor | None:
    """``q`` ``[T, H, D]`` over the context at ``slots`` ``[ctx]`` in the pools ``[num_slots, Hkv,
    D]``: query ``i`` at context position ``positions[i]`` (``[T]`` int64, each < ctx) sees the
    keys up to it; without ``positions`` the queries are the context's last ``T``. The output
    ``[T, H, D]`` in their dtype, or None where the kernel does not serve (the caller runs
    torch's)."""
    if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in DTYPES and q.device.type == "cpu"
            and q.shape[-1] in DIMS and k_cache.is_contiguous() and v_cache.is_contiguous() and _checked(q.dtype)):
        return None
    if positions is not None and (positions.numel() != q.shape[0] or (
            positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < slots.numel())):
        return None
    return _run(q, k_cache, v_cache, slots, scale, positions)


def _run(q, k_cache, v_cache, slots, scale, positions=None) -> torch.Tensor | None:
    num_tokens, heads, dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != dim:  # heads contiguous; any token stride (a view of QKV's output)
        q = q.contiguous()
    slots = slots.to(torch.int64).contiguous()
    if positions is not None:
        positions = positions.to(torch.int64).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    fn = _library().prefill_attention if q.dtype == torch.bfloat16 else _library().prefill_attention_f32
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            None if positions is None else positions.data_ptr(), slots.numel(), num_tokens, heads, k_cache.shape[1],
            dim, q.stride(0), scale, out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def on_amx_tiles() -> bool:
    """Whether bfloat16 spans run on AMX tiles in this process (``prefill_attention_amx.c``: built with AMX
    and granted the tile state by the OS); else the AVX512-BF16 kernel serves them."""
    lib = _library()
    return lib is not None and bool(lib.prefill_attention_amx_ready())


@functools.cache
def _checked(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernel in ``dtype`` against torch's float32 attention on a small random case with a
    cached part."""
    lib = _library()
    if lib is None:
        return False
    g = torch.Generator().manual_seed(0)
    for dim in DIMS:
        k, v = (torch.randn(120, 2, dim, generator=g).to(dtype) for _ in range(2))
        slots = torch.randperm(120, generator=g)[:77]
        q = torch.randn(45, 6, dim, generator=g).to(dtype)
        out = _run(q, k, v, slots, dim**-0.5)
        if out is None:
            log.info("no %s prefill attention kernel on this CPU: torch's attention runs", dtype)
            return False
        past = slots.numel() - q.shape[0]
        mask = torch.ones(q.shape[0], slots.numel(), dtype=torch.bool).tril(past)
        want = F.scaled_dot_product_attention(
            q.float().transpose(0, 1), k[slots].float().transpose(0, 1).repeat_interleave(3, 0),
            v[slots].float().transpose(0, 1).repeat_interleave(3, 0), attn_mask=mask, scale=dim**-0.5).transpose(0, 1)
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        if not torch.allclose(out.float(), want, atol=tol, rtol=tol):
            log.warning("%s prefill attention kernel disagrees with torch here; torch's attention runs", dtype)
            return False
    return True
