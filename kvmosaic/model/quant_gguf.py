"""4-bit weight-only projections from a GGUF's own Q4_1 blocks (opt-in: ``quantization="gguf"``,
``--quantization gguf``; vLLM's name for serving GGUF-quantized weights).

The shipped model is a Q4_1 GGUF: every projection is stored as blocks of 32 weights with a
float16 scale ``d`` and minimum ``m`` (``w = d * q + m``, 4-bit ``q``). The default path
dequantizes them and computes in the model's dtype, so decode reads 2 (bfloat16) or 4 bytes a
weight; this path keeps the blocks (0.625 bytes a weight) and computes on them. Nothing is
re-quantized: the weights are exactly the file's, i.e. exactly the float model's weights before
they are rounded to the compute dtype.

Which kernel runs depends on the rows in the step:

* up to :data:`GEMV_MAX_ROWS` rows (decode, short cache-hit suffixes): ``q4_1_matmul.c``
  (``model/kernels``), reading each block once for all rows: ``y = x @ W^T`` with ``x`` as the
  model's dtype holds it, the weights dequantized exactly (float32), float32 accumulation, the
  result rounded to the model's dtype. Each row is computed on its own and the same way whatever
  the number of rows (batch invariance: checked when the kernel is loaded, and by
  ``tests/test_quant_gguf.py``);
* more rows (prefill): the blocks dequantized to the model's dtype and a torch GEMM, which is
  the default path's product on the default path's weights.

The two agree up to the compute dtype's rounding of the weights (bfloat16: 8 bits), so the model
as a whole is not the default-path model: its distance from it is measured, not assumed
(``python -m kvmosaic.bench.quant``, BENCHMARKS.md). An LM head stored as Q8_0 (the shipped
file's tied embedding) computes on its blocks in float32 models (:class:`Q8_0Head`: exactly the
float weights, a quarter of the bytes); tensors in other GGUF formats, and a Q8_0 head in
bfloat16, keep the default path; the log says which. The
quantization is part of the model's identity (``quant.quantized_fingerprint``), so its KV never
meets float KV in the prefix cache or a storage tier (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .loader import LoadedWeights

log = logging.getLogger("kvmosaic")

GEMV_MAX_ROWS = 8  # a 2-core Xeon (AMX), 3072x576: kernel and bf16 GEMM on dequantized weights tie at 8 rows

# (module name in DecoderLayer, its Hugging Face weight if stored fused, the parts otherwise)
FUSED = (
    ("qkv_proj", "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o_proj", "self_attn.o_proj", ()),
    ("gate_up_proj", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("down_proj", "mlp.down_proj", ()),
)


class Q4_1Linear(nn.Module):
    """A bias-free linear layer over Q4_1 blocks ``[out, in / 32 * 20]`` (uint8, as the file
    stores them; kept split: ``kernels.Q4_1Weights``). Input ``[tokens, in]`` in the model's
    dtype; output in that dtype, or float32 with ``logits``."""

    def __init__(self, blocks: torch.Tensor, in_features: int, logits: bool = False) -> None:
        super().__init__()
        if in_features % kernels.Q4_1_BLOCK or blocks.shape[1] != in_features // kernels.Q4_1_BLOCK * kernels.Q4_1_BYTES:
            raise ValueError(f"Q4_1 blocks {tuple(blocks.shape)} do not hold {in_features} inputs a row")
        self.in_features, self.out_features = in_features, blocks.shape[0]
        split = kernels.q4_1_split(blocks)
        self.register_buffer("qs", split.qs)
        self.register_buffer("d", split.d)
        self.register_buffer("m", split.m)
        self.logits = logits
        self.gemv = kernels.q4_1_available()  # CPU tensors only (forward checks the device)

    @property
    def weights(self) -> kernels.Q4_1Weights:
        return kernels.Q4_1Weights(self.qs, self.d, self.m)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[out, in]`` weight in ``dtype`` (the file's weights, rounded to ``dtype``)."""
        if self.gemv and dtype in (torch.float32, torch.bfloat16) and self.qs.device.type == "cpu":
            return kernels.q4_1_dequantize(self.weights, dtype)
        return kernels.q4_1_reference(self.weights).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.gemv and x.shape[0] <= GEMV_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16)
                and x.device.type == "cpu"):
            y = kernels.q4_1_matmul(self.weights, x)
        else:
            y = F.linear(x, self.dequantized(x.dtype))
        return y.float() if self.logits else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemv={self.gemv}"


class Q8_0Head(nn.Module):
    """The LM head over a GGUF's Q8_0 blocks (the shipped file's tied embedding), float32 models
    only: ``w = d * q`` is exactly the float32 weight, so up to :data:`GEMV_MAX_ROWS` rows read
    its 1.06 bytes a weight (``q8_0_matmul.c``) instead of 4; more rows (a prefill batch's last
    tokens) take torch's GEMM on the dense weight the model keeps anyway (its embedding table).
    Output: float32 logits."""

    def __init__(self, blocks: torch.Tensor, dense: torch.Tensor) -> None:
        super().__init__()
        split = kernels.q8_0_split(blocks)
        if split.qs.shape != dense.shape or not torch.equal(kernels.q8_0_reference(split), dense.detach()):
            raise ValueError("gguf: the LM head's Q8_0 blocks do not dequantize to the loaded weight")
        self.register_buffer("qs", split.qs)
        self.register_buffer("d", split.d)
        self.dense = dense.detach()  # the model's weight (tied embedding or lm_head): shared, not a copy

    @staticmethod
    def serves(dense: torch.Tensor) -> bool:
        return dense.dtype == torch.float32 and dense.device.type == "cpu" and kernels.q8_0_available()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel for any number of rows (each on its own: the fused step's batch-invariant head)."""
        return kernels.q8_0_matmul(kernels.Q8_0Weights(self.qs, self.d), x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.rows(x)
        return F.linear(x, self.dense).float()


def _blocks_of(weights: LoadedWeights, fused: str, parts: tuple[str, ...]) -> torch.Tensor | None:
    """The Q4_1 blocks of a (fused) projection, rows in the order the model concatenates them;
    None when any part is stored in another format."""
    q4 = weights.q4_1_blocks or {}
    if f"{fused}.weight" in q4:
        return q4[f"{fused}.weight"]
    names = [f"{p}.weight" for p in parts]
    if not names or not all(n in q4 for n in names):
        return None
    return torch.cat([q4[n] for n in names])


def require_q4_1(weights: LoadedWeights) -> None:
    """Refuse (ValueError) weights that are not a GGUF loaded with ``keep_q4_1`` holding Q4_1 tensors."""
    if weights.gguf_file is None:
        raise ValueError(f'quantization="gguf" computes with a GGUF file\'s Q4_1 blocks; {weights.name} is not a '
                         "GGUF file (serve it without quantization, or with int8)")
    if weights.q4_1_blocks is None:
        raise ValueError(f'quantization="gguf": {weights.gguf_file} was loaded without its Q4_1 blocks '
                         "(load_weights(..., keep_q4_1=True))")
    if not weights.q4_1_blocks:
        stored = sorted(set((weights.formats or {}).values()))
        raise ValueError(f'quantization="gguf" needs Q4_1 blocks; {weights.gguf_file} stores {", ".join(stored)}')


def quantize_gguf(model: nn.Module, weights: LoadedWeights) -> int:
    """Swap every projection (and the LM head) whose weights the file stores as Q4_1 for a
    :class:`Q4_1Linear` over those blocks, after checking that the blocks dequantize to exactly
    the weights the model loaded (rounded to its dtype). Returns how many were swapped.

    Raises ValueError when the weights are not a GGUF or hold no Q4_1 tensor."""
    require_q4_1(weights)
    kept: dict[str, str] = {}
    count = 0
    for i, layer in enumerate(model.layers):
        for attr, fused, parts in FUSED:
            prefix = f"model.layers.{i}."
            blocks = _blocks_of(weights, prefix + fused, tuple(prefix + p for p in parts))
            current = getattr(layer, attr)
            if blocks is None:
                names = [prefix + n + ".weight" for n in (parts or (fused,))]
                kept.update({n: (weights.formats or {}).get(n, "?") for n in names})
                continue
            setattr(layer, attr, _checked(Q4_1Linear(blocks, current.weight.shape[1]), current.weight, prefix + fused))
            count += 1
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    if head_name in weights.q4_1_blocks:
        model.head_proj = _checked(Q4_1Linear(weights.q4_1_blocks[head_name], model.output_weight.shape[1], logits=True),
                                   model.output_weight, "LM head")
        count += 1
    elif head_name in (weights.q8_0_blocks or {}) and Q8_0Head.serves(model.output_weight):
        model.head_proj = Q8_0Head(weights.q8_0_blocks[head_name], model.output_weight)
        count += 1
    else:
        kept[head_name + " (LM head)"] = (weights.formats or {}).get(head_name, "?")
    by_format: dict[str, int] = {}
    for fmt in kept.values():
        by_format[fmt] = by_format.get(fmt, 0) + 1
    log.info("gguf: %d projections compute on their Q4_1 blocks%s; kept dequantized: %s", count,
             "" if kernels.q4_1_available() else " (no Q4_1 kernel here: dequantized per call)",
             ", ".join(f"{n} ({f})" for n, f in list(kept.items())[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
             if kept else "none")
    return count


def _checked(layer: Q4_1Linear, weight: torch.Tensor, what: str) -> Q4_1Linear:
    """``layer``, after checking that its blocks are the rows of ``weight`` (the float model's,
    in the model's dtype): a wrong row order (RoPE un-permutation, fusion) cannot pass. The
    layer moves to ``weight``'s device (off the CPU it multiplies its blocks dequantized per call)."""
    layer = layer.to(weight.device)
    if not torch.equal(layer.dequantized(weight.dtype), weight.detach()):
        raise ValueError(f"gguf: {what}'s Q4_1 blocks do not dequantize to the loaded weight (row order?)")
    return layer
