"""Gemma 2 and Gemma 3's decoder layer: where it differs from Llama's, and nothing else.

* RMSNorm scales by ``1 + w`` and multiplies in float32 before casting back;
* four norms a layer ("sandwich"): the attention output and the MLP output are normed before
  their residual adds (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the
  MLP input by ``pre_feedforward_layernorm`` — so Gemma's ``post_attention_layernorm`` is not
  Llama's (which is the MLP's input norm).

The rest (GeGLU, embedding scale, query_pre_attn_scalar, soft-capping, windows, q/k norms,
per-layer RoPE base) are switches of the shared decoder, read into ``families.Traits``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, PagedKV
from .config import ModelConfig
from .llama import DecoderLayer, QueryRows, RMSNorm
from .rotary import RopeAt


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + w)``, all in float32, as transformers' Gemma RMSNorm."""

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(DecoderLayer):
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeAt, kv: PagedKV,
                meta: AttentionMetadata, rows: QueryRows | None = None) -> tuple[torch.Tensor, None]:
        """The layer on the hidden state ``x + residual``; returns the next hidden state whole
        (its norms sit after the adds, so there is no residual to carry apart). ``rows`` as in
        :meth:`DecoderLayer.forward`."""
        hidden = x if residual is None else x + residual
        q = self.qkv_stored(self.input_layernorm(hidden), rope, kv, meta.slot_mapping)
        if rows is not None:
            q, hidden, meta = q.index_select(0, rows.index), hidden.index_select(0, rows.index), rows.meta
        return self.finish(hidden, self.attend(q, kv, meta)), None

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection and its norm, residual; the normed GeGLU MLP and its norm, residual."""
        x = x + self.post_attention_layernorm(self.o_proj(attn.flatten(1)))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(self.act(gate) * up))
