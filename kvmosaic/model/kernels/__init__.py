"""CPU kernels written for kvmosaic, built on first use with the system's C compiler.

Only what torch has no fast path for lives here:

* :func:`paged_decode_attention` reads a decode batch's K and V in place in the paged pool
  (``paged_decode.c``), where the torch path gathers every context into a padded copy and
  upcasts it to float32 (``model/attention.py``);
* :func:`rms_norm` (with the residual add), :func:`rope_` and :func:`silu_mul` do in one pass
  what takes torch two to ten operator calls each (``elementwise.c``, wrapped in ``rows.py``, with
  :func:`rope_store`, RoPE and the KV write in one pass): at decode, with one token per sequence,
  those calls' dispatch is a large part of the step. They round where torch rounds;
* ``prefill.prefill_attention``: causal prefill attention over the pool in place, bfloat16 on
  AVX512-BF16 and float32 on AVX-512 or AVX2 (``prefill_attention.c``, ``prefill_attention_avx2.c``), where torch's flash kernel ran
  at ~10% of the GEMM peak on a CPU without AMX;
* :func:`q4_1_matmul` and :func:`q4_1_dequantize` compute with a GGUF's own Q4_1 blocks
  (``q4_1_matmul.c``, for ``quantization="gguf"``: model/quant_gguf.py); checked at load
  against a torch reference on their own (:func:`q4_1_available`), so a disagreement turns off
  only them.

The shared library is compiled once per source, compiler and CPU into
``$KVMOSAIC_KERNEL_CACHE`` (default ``~/.cache/kvmosaic/kernels``) in about a second, and
loaded with ctypes. Nothing is required: with no compiler, a failed build, a result that
disagrees with torch's attention on a check run at load time, or ``KVMOSAIC_KERNELS=0``,
:func:`available` is False and attention keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from ... import paths

log = logging.getLogger("kvmosaic")

SOURCES = [Path(__file__).with_name(name)
           for name in ("paged_decode.c", "elementwise.c", "q4_1_matmul.c", "q8_0_matmul.c", "decode_step.c",
                        "prefill_attention.c", "prefill_attention_amx.c", "prefill_attention_avx2.c")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("amx.h", "bf16.h", "elementwise.h", "paged_decode.h", "decode_step_layers.h", "q4_1_avx2.h", "q4_1_bf16.h",
                        "prefill_softmax.h")]
# No FMA contraction: a * b + c rounds the product as torch's separate operators do.
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off"]
MAX_GROUP, MAX_DIM = 16, 256  # as in paged_decode.c


def _cache_dir() -> Path:
    return paths.cache_dir("kernels", "KVMOSAIC_KERNEL_CACHE")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    """The library for this source, compiler, CPU and ``KVMOSAIC_KERNEL_DEFINES`` (extra ``-D``
    names, for studies: e.g. ``KVMOSAIC_PHASE_TIMERS``, decode_step.c); built (atomically:
    parallel processes race harmlessly) when not cached yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [path.read_text() for path in SOURCES + HEADERS]
    defines = os.environ.get("KVMOSAIC_KERNEL_DEFINES", "").split()
    key = hashlib.sha256("\0".join([*texts, *FLAGS, *(f"-D{d}" for d in defines), version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kvmosaic-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compile_library(compiler, SOURCES, defines, built)
        os.replace(built, target)
    return target


def compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(cc: str, sources: list[Path], defines: list[str], out: Path) -> None:
    """``sources`` (their headers beside them) compiled with :data:`FLAGS` and ``-D`` ``defines`` into the
    shared library ``out``."""
    subprocess.run([cc, *FLAGS, *(f"-D{d}" for d in defines), *map(str, sources), "-o", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVMOSAIC_KERNELS", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler: decode attention uses the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernel build failed, decode attention uses the torch path: %s", str(detail)[-500:])
        return None
    lib = _declared(lib)
    return lib if _agrees_with_torch(lib) else None


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with its functions' argument and result types set."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "paged_decode_attention": (i32, [ptr] * 3 + [i32] * 2 + [ptr] * 2 + [i64] * 5 + [f32, ptr, ptr, i32]),
        "rms_norm": (None, [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, f32, i32, i32]),
        "silu_mul": (None, [ptr, i64, ptr, i64, i64, i32, i32]),
        "rope_store": (None, [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i32, i32]),
        "rerotate_store": (None, [ptr] + [i64] * 7 + [ptr] * 5 + [i32, i32]),
        "q4_1_matmul": (i32, [ptr] * 4 + [i32, i64, i64, i64, ptr, i32, i32]),
        "q4_1_dequantize": (i32, [ptr] * 3 + [i64, i64, ptr, i32, i32]),
        "q8_0_matmul": (i32, [ptr] * 3 + [i64] * 3 + [ptr, i32]),
        "decode_step": (i32, [ptr] + [i64] * 6 + [f32, f32] + [ptr] * 6 + [i64, i64, ptr, ptr, i64, ptr, i32, i64, i32,
                                                                             i32]),
        "linear_rows": (i32, [ptr, i64, i64, i32, ptr, i64, ptr, i32, i32]),
        "linear_amx": (i32, [ptr, i64, i64, ptr, i64, i64, ptr, i32]),
        "linear_amx_silu": (i32, [ptr, i64, i64, ptr, i64, ptr, i64, i32]),
        "decode_tile_shape": (i32, [i32, ptr]),
        "decode_step_amx": (i32, []),
        "prefill_attention": (i32, [ptr] * 5 + [i64] * 6 + [f32, ptr, i32]),
        "prefill_attention_f32": (i32, [ptr] * 5 + [i64] * 6 + [f32, ptr, i32]),
        "prefill_attention_amx_ready": (i32, []),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


# Where the kernel may stand from torch's float32 attention: (atol = rtol of the output, atol of the log-sum-exp).
# In bfloat16 the probabilities are rounded to bfloat16 before P.V (on AVX512-BF16 and on AMX tiles, decode_rows_amx),
# as the prefill kernels and FlashAttention round them (relative 2^-9 each), and on the tiles exponentials come from a
# degree-3 fit (9e-5).
AGREEMENT = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 3e-4)}


def _agrees_with_torch(lib: ctypes.CDLL) -> bool:
    """Run the kernel on a small random batch in both pool dtypes and compare it with torch's
    attention on gathered float32 copies (:data:`AGREEMENT`)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tol, lse_tol = AGREEMENT[dtype]
        k = torch.randn(80, 2, 64, generator=g).to(dtype)
        v = torch.randn(80, 2, 64, generator=g).to(dtype)
        q = torch.randn(3, 6, 64, generator=g).to(dtype)
        slots = torch.randperm(80, generator=g)[:60].view(3, 20)
        lens = torch.tensor([20, 7, 1])
        out, lse = _attention(lib, q, k, v, slots, lens, 0.125)
        for b in range(3):
            s = slots[b, : lens[b]]
            kb = k[s].float().transpose(0, 1).repeat_interleave(3, 0)  # [H, n, D]
            vb = v[s].float().transpose(0, 1).repeat_interleave(3, 0)
            scores = torch.einsum("hd,hnd->hn", q[b].float(), kb) * 0.125
            want = torch.einsum("hn,hnd->hd", scores.softmax(-1), vb)
            if not (torch.allclose(out[b], want, atol=tol, rtol=max(tol, 1e-4))
                    and torch.allclose(lse[b], scores.logsumexp(-1), atol=lse_tol, rtol=1e-5)):
                log.warning("CPU decode-attention kernel disagrees with torch here; using the torch path")
                return False
    return True


def _attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, dim = q.shape
    q_bf16_exact = int(q.dtype == torch.bfloat16)
    q = q.float().contiguous()
    slots, lens = slots.contiguous(), lens.contiguous()
    out = torch.empty(batch, heads, dim)
    lse = torch.empty(batch, heads)
    rc = lib.paged_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16), q_bf16_exact, slots.data_ptr(), lens.data_ptr(),
        batch, heads, k.shape[1], dim, slots.shape[1], scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode_attention: unsupported shape heads={heads} kv_heads={k.shape[1]} dim={dim}")
    return out, lse


def available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention` serves this query and pool."""
    heads, dim = q.shape[-2:]
    kv_heads = k_cache.shape[1]
    return (q.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.is_contiguous()
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and dim <= MAX_DIM
            and _library() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[B, H, D]`` attends the first ``lens[b]`` (>= 1) of ``slots[b]`` in the pool
    ``[num_slots, Hkv, D]``. Returns the output ``[B, H, D]`` and the log-sum-exp of the scaled
    scores ``[B, H]``, both float32. Call only where :func:`available` is True."""
    return _attention(_library(), q, k_cache, v_cache, slots, lens, scale)


def decode_step_library() -> ctypes.CDLL | None:
    """The library whose ``decode_step`` runs a whole decode step (``decode_step.c``;
    model/fused_decode.py checks at its first call whether this CPU and model are served)."""
    return _library()


# ---- Q4_1 (quantization="gguf") ----------------------------------------------------------

Q4_1_BLOCK, Q4_1_BYTES = 32, 20  # weights per block; bytes per block (fp16 d, fp16 m, 16 nibble bytes)


class Q4_1Weights(NamedTuple):
    """A GGUF Q4_1 tensor ``[out, in]`` split for the kernels, exactly: ``qs`` uint8
    ``[out, in / 2]`` (each block's 16 nibble bytes as stored), ``d`` and ``m`` float32
    ``[out, in / 32]`` (the blocks' float16 scales and minima, widened)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * 2


def q4_1_split(blocks: torch.Tensor) -> Q4_1Weights:
    """Split Q4_1 ``blocks`` ``[out, in / 32 * 20]`` (uint8, as a GGUF file stores them)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(out, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float().reshape(out, -1)
    return Q4_1Weights(b[..., 4:].reshape(out, -1).contiguous(), d.contiguous(), m.contiguous())


def q4_1_reference(w: Q4_1Weights) -> torch.Tensor:
    """The float32 ``[out, in]`` weights, in torch: ``d * q + m``, each step rounded to float32
    (as gguf-py's dequantize computes)."""
    out = w.qs.shape[0]
    qs = w.qs.reshape(out, -1, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [out, nb, 32]: low nibbles are 0..15
    return (w.d[..., None] * q + w.m[..., None]).reshape(out, -1)


def _q4_1_agrees(lib: ctypes.CDLL) -> bool:
    """The kernels against :func:`q4_1_reference` on random blocks: the dequantization exactly,
    the product within float32 summation-order noise, and each row alone equal to the batch."""
    g = torch.Generator().manual_seed(0)
    out, inf = 70, 96
    blocks = torch.randint(0, 256, (out, inf // Q4_1_BLOCK, Q4_1_BYTES), generator=g, dtype=torch.uint8)
    scales = torch.stack([torch.rand(out, inf // Q4_1_BLOCK, generator=g) * 0.01,
                          -torch.rand(out, inf // Q4_1_BLOCK, generator=g) * 0.08], -1).half()
    blocks[..., 0:4] = scales.view(torch.uint8).reshape(out, inf // Q4_1_BLOCK, 4)
    w = q4_1_split(blocks.reshape(out, -1))
    want_w = q4_1_reference(w)
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(_q4_1_dequantize(lib, w, dtype), want_w.to(dtype)):
            return False
        x = torch.randn(9, inf, generator=g).to(dtype)
        y = _q4_1_matmul(lib, w, x, torch.float32)
        want = x.float() @ want_w.T
        alone = torch.cat([_q4_1_matmul(lib, w, x[i : i + 1], torch.float32) for i in range(9)])
        if not (torch.allclose(y, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())) and torch.equal(y, alone)):
            return False
    return True


@functools.cache
def q4_1_available() -> bool:
    """Whether the Q4_1 kernels are built here and agree with the torch reference."""
    lib = _library()
    if lib is None:
        return False
    if not _q4_1_agrees(lib):
        log.warning("Q4_1 kernel disagrees with its torch reference here; gguf projections dequantize instead")
        return False
    return True


def _q4_1_matmul(lib: ctypes.CDLL, w: Q4_1Weights, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    x = x.contiguous()
    rows, inf = x.shape
    y = torch.empty(rows, w.qs.shape[0], dtype=out_dtype)
    rc = lib.q4_1_matmul(w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), x.data_ptr(), int(x.dtype == torch.bfloat16),
                         rows, inf, w.qs.shape[0], y.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"q4_1_matmul: unsupported shape in={inf}")
    return y


def _q4_1_dequantize(lib: ctypes.CDLL, w: Q4_1Weights, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(w.qs.shape[0], w.in_features, dtype=dtype)
    if lib.q4_1_dequantize(w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), w.in_features, w.qs.shape[0], y.data_ptr(),
                           int(dtype == torch.bfloat16), torch.get_num_threads()) != 0:
        raise ValueError(f"q4_1_dequantize: unsupported in_features={w.in_features}")
    return y


def q4_1_matmul(w: Q4_1Weights, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, in]`` (float32 or bfloat16, CPU) times the transposed Q4_1 weight:
    ``[rows, out]`` in ``x``'s dtype, float32-accumulated (numerics: ``q4_1_matmul.c``). Call
    only where :func:`q4_1_available`."""
    return _q4_1_matmul(_library(), w, x, x.dtype)


def q4_1_dequantize(w: Q4_1Weights, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[out, in]`` weight in ``dtype`` (float32 or bfloat16), equal to
    :func:`q4_1_reference` rounded to ``dtype``. Call only where :func:`q4_1_available`."""
    return _q4_1_dequantize(_library(), w, dtype)


# ---- Q8_0 (quantization="gguf": the shipped file's embedding / tied LM head) ----------------

Q8_0_BYTES = 34  # bytes per block of 32 weights (fp16 d, 32 int8 q)


class Q8_0Weights(NamedTuple):
    """A GGUF Q8_0 tensor ``[out, in]`` split for the kernel, exactly: ``qs`` int8 ``[out, in]``,
    ``d`` float32 ``[out, in / 32]`` (the blocks' float16 scales, widened)."""

    qs: torch.Tensor
    d: torch.Tensor


def q8_0_split(blocks: torch.Tensor) -> Q8_0Weights:
    """Split Q8_0 ``blocks`` ``[out, in / 32 * 34]`` (uint8, as a GGUF file stores them)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, Q8_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(out, -1)
    return Q8_0Weights(b[..., 2:].contiguous().view(torch.int8).reshape(out, -1), d.contiguous())


def q8_0_reference(w: Q8_0Weights) -> torch.Tensor:
    """The float32 ``[out, in]`` weights: ``d * q``, exact."""
    out = w.qs.shape[0]
    return (w.d[..., None] * w.qs.reshape(out, -1, Q4_1_BLOCK).float()).reshape(out, -1)


def _q8_0_matmul(lib: ctypes.CDLL, w: Q8_0Weights, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.qs.shape[0], dtype=torch.float32)
    if lib.q8_0_matmul(w.qs.data_ptr(), w.d.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], w.qs.shape[0],
                       y.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"q8_0_matmul: unsupported shape in={x.shape[1]}")
    return y


@functools.cache
def q8_0_available() -> bool:
    """Whether the Q8_0 kernel is built here and agrees with :func:`q8_0_reference` (within float32
    summation-order noise, each row alone equal to the batch)."""
    lib = _library()
    if lib is None:
        return False
    g = torch.Generator().manual_seed(0)
    out, inf = 70, 96
    blocks = torch.randint(0, 256, (out, inf // Q4_1_BLOCK, Q8_0_BYTES), generator=g, dtype=torch.uint8)
    blocks[..., 0:2] = (torch.rand(out, inf // Q4_1_BLOCK, 1, generator=g) * 0.01).half().view(torch.uint8)
    w = q8_0_split(blocks.reshape(out, -1))
    x = torch.randn(9, inf, generator=g)
    y, want = _q8_0_matmul(lib, w, x), x @ q8_0_reference(w).T
    alone = torch.cat([_q8_0_matmul(lib, w, x[i : i + 1]) for i in range(9)])
    if not (torch.allclose(y, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())) and torch.equal(y, alone)):
        log.warning("Q8_0 kernel disagrees with its torch reference here; the gguf LM head stays dense")
        return False
    return True


def q8_0_matmul(w: Q8_0Weights, x: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` ``[rows, in]`` (CPU) times the transposed Q8_0 weight: ``[rows, out]`` float32
    (numerics: ``q8_0_matmul.c``). Call only where :func:`q8_0_available`."""
    return _q8_0_matmul(_library(), w, x)


# The row kernels' wrappers (RMSNorm, RoPE and the KV write, SiLU·up): rows.py.
from .rows import PoolRows, elementwise_available, pool_rows, rerotate_store, rms_norm, rope_, rope_store, silu_mul  # noqa: E402, F401
