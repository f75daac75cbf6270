"""Weight-only int8 quantization (opt-in: ``quantization="int8"``, ``--quantization int8``).
The other weight-only path, ``quantization="gguf"`` (the GGUF's own Q4_1 blocks), is
``quant_gguf.py``; both share :data:`QUANTIZATIONS` and :func:`quantized_fingerprint`.

Each projection's weight (and the LM head) is stored as int8 with one float scale per output
channel (symmetric, ``scale = max|w_row| / 127``); activations stay in the model's dtype. Decode
reads every weight once per step, so a quarter of float32's bytes is most of the win on a CPU.

One numerics, two kernels. A projection computes ``bf16(bf16(x) @ q.T * scale)``: activations
are rounded to bfloat16 on the way in and the product on the way out, because that is what
torch's int8 GEMV (``_weight_int8pack_mm``, which takes bfloat16 activations on CPU) computes.
Which kernel runs depends on the rows in the step:

* up to :data:`GEMV_MAX_ROWS` rows (decode, short cache-hit suffixes): the int8 GEMV, which
  reads a quarter of float32's bytes;
* more rows (prefill): a float GEMM on the int8 weight cast to the activation dtype, with the
  same roundings around it (the GEMV is slower than a GEMM there; measured in BENCHMARKS.md).

The LM head is the same layer, except that its top logits are recomputed unrounded
(:class:`Int8LogitsHead`): a bfloat16 logit is only good to 1/8 nat.

The kernels agree up to float32 accumulation order, and the GEMV computes each row on its own
(both checked on construction and by ``tests/test_quant.py``). Still, a batch's composition
moves an int8 model's log-probabilities more than a float model's (~1e-2 against ~1e-5): float
noise of 1e-6 in attention flips an occasional bfloat16 rounding, and 30 layers compound it.

The model as a whole is not the float model: its distance from it is measured, not assumed
(``python -m kvmosaic.bench.quant``, BENCHMARKS.md; ``tests/test_quant.py``). The quantization is
part of the model's identity (:func:`quantized_fingerprint`), so int8 KV never meets float KV in
the prefix cache or a storage tier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8", "gguf")
GEMV_MAX_ROWS = 64  # measured on an AVX2 EPYC: the int8 GEMV beats the cast-weight GEMM up to ~100 rows


def quantized_fingerprint(weights_fingerprint: str, quantization: str | None) -> str:
    """The identity of the weights the model computes with: quantized weights give other KV."""
    return weights_fingerprint if quantization is None else f"{weights_fingerprint}+{quantization}-weight-only"


class Int8WeightOnlyLinear(nn.Module):
    """A bias-free linear layer with an int8 weight and per-output-channel scales."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).bfloat16().clamp(min=torch.finfo(torch.bfloat16).tiny)
        self.out_features, self.in_features = w.shape
        self.register_buffer("qweight", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.gemv = _gemv_supported(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] <= GEMV_MAX_ROWS:
            return torch._weight_int8pack_mm(x.bfloat16(), self.qweight, self.scale).to(x.dtype)
        dt = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
        y = F.linear(x.bfloat16().to(dt), self.qweight.to(dt)) * self.scale.to(dt)
        return y.bfloat16().to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemv={self.gemv}"


class Int8LogitsHead(Int8WeightOnlyLinear):
    """The LM head, returning float32 logits whose top :attr:`shortlist` are not rounded.

    The int8 product's bfloat16 output keeps 8 significant bits: at the logits' usual size
    (16 to 32) that is a resolution of 1/8 nat, so the top of the distribution is full of exact
    ties and greedy picks among them by index. The ``shortlist`` highest logits of each row are
    recomputed in float32 from the same int8 weights and scales (the same model, unrounded); the
    rest keep the rounded value, which moves a tail token's probability by under 0.4%.
    """

    shortlist = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x).float()
        top = logits.topk(min(self.shortlist, logits.shape[-1]), dim=-1).indices  # [T, k]
        rows = self.qweight[top].float()  # [T, k, in]
        exact = torch.einsum("ti,tki->tk", x.bfloat16().float(), rows) * self.scale[top].float()
        return logits.scatter_(-1, top, exact)


def _gemv_supported(qweight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether torch's int8 GEMV runs here, agrees with the dequantized product, and computes
    each row independently of the others (the batch invariance the module promises)."""
    if qweight.device.type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
        return False
    x = torch.randn(40, qweight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    try:
        got = torch._weight_int8pack_mm(x, qweight, scale)
        rows = torch.cat([torch._weight_int8pack_mm(x[i : i + 3], qweight, scale) for i in range(0, 40, 3)])
    except (RuntimeError, NotImplementedError):
        return False
    want = F.linear(x.float(), qweight.float()) * scale.float()
    close = torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    return bool(close and torch.equal(got, rows))


def quantize_int8(model: nn.Module) -> int:
    """Swap every decoder projection and the LM head for :class:`Int8WeightOnlyLinear`.
    Returns how many layers were quantized. The embedding stays in the model's dtype (a
    lookup reads one row per token)."""
    count = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(layer, name, Int8WeightOnlyLinear(getattr(layer, name).weight))
            count += 1
    model.head_proj = Int8LogitsHead(model.output_weight)
    return count + 1
