"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) that reads and
writes its KV through the paged pool.

Q/K/V and gate/up projections are fused into one weight each, so a layer is four GEMMs over
the whole packed batch. Numerics follow Hugging Face's Llama (norms in float32, RoPE tables
in float32), so float32 logits match transformers on the same weights.

The layers pass the residual stream beside the sublayer output, as vLLM's models do, so that
each RMSNorm adds the residual in the same pass (``model/kernels``, on a CPU with a C compiler;
torch operators otherwise, with the same roundings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import AttentionMetadata, PagedKV, paged_attention
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)``; with ``residual``, ``norm(x + residual)``, the sum written into
        ``residual`` in place (the stream the next sublayer adds to)."""
        if x.dim() == 2 and kernels.elementwise_available(x) and self.weight.dtype == x.dtype:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables in float32 for every position up to ``max_positions``. The sin table is
    stored with the first half negated, so that :func:`apply_rope` rotates with one ``roll``."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("signed_sin", emb.sin() * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.signed_sin[positions].to(dtype)[:, None, :]


class RopeAt:
    """The rotary tables at one step's positions (float32 ``[T, D]``), applied to q and k."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.cos, self.signed_sin = cos, signed_sin

    @classmethod
    def at(cls, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeAt:
        return cls(rotary.cos[positions], rotary.signed_sin[positions])

    def select(self, index: torch.Tensor) -> RopeAt:
        return RopeAt(self.cos[index], self.signed_sin[index])

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]``; in place where the kernel runs (heads contiguous)."""
        if kernels.elementwise_available(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return kernels.rope_(x, self.cos, self.signed_sin)
        return apply_rope(x, self.cos.to(x.dtype)[:, None, :], self.signed_sin.to(x.dtype)[:, None, :])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotation of each (first half, second half) pair (blend/rope.py uses it)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` as in transformers, bit for bit: ``rotate_half(x)`` is
    ``cat(-x2, x1)``, which is ``roll(x, D/2)`` with the first half's sign moved into the table."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.split_qk_v = (q + kv, kv)
        self.scale = cfg.head_dim**-0.5

    def qkv(self, h: torch.Tensor, rope: RopeAt):
        """Normed input -> rotated q ``[T, H, D]``, rotated k and v ``[T, Hkv, D]`` (q and k are
        rotated together: one pass per layer, not two)."""
        qkv = self.qkv_proj(h)
        qk = rope.apply_(qkv[:, : self.split_qk_v[0]].view(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, qkv[:, self.split_qk_v[0] :].view(-1, self.num_kv_heads, self.head_dim)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeAt, kv: PagedKV,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the residual stream: ``x`` is the previous layer's MLP output and
        ``residual`` the stream before it (None at the first layer, where ``x`` is the stream
        itself and becomes ``residual``, updated in place). Returns (MLP output, stream): the
        hidden state is their sum."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        q, k, v = self.qkv(h, rope)
        kv.write(self.layer_idx, meta.slot_mapping, k, v)
        attn = paged_attention(q, kv.k[self.layer_idx], kv.v[self.layer_idx], meta, self.scale)
        h = self.post_attention_layernorm(self.o_proj(attn.flatten(1)), residual)
        return self.mlp(h), residual

    def hidden(self, x: torch.Tensor, rope: RopeAt, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        """The layer on a hidden state (``x`` left as it is): the layer-by-layer API of
        segment reuse (``blend/forward.py``)."""
        out, residual = self(x.clone(), None, rope, kv, meta)
        return out + residual

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """From a layer's attention output to its hidden state, ``x`` being the layer's input
        hidden state (left as it is)."""
        residual = x.clone()
        h = self.post_attention_layernorm(self.o_proj(attn.flatten(1)), residual)
        return residual + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_proj: nn.Module | None = None  # replaces the plain head product: pack_linears, quant.py

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32 logits."""
        head = self.head_proj
        h = self.norm(hidden)
        return (head(h) if head is not None else F.linear(h, self.output_weight)).float()

    def pack_linears(self) -> int:
        """Swap every projection (and the LM head) for a oneDNN pre-packed one where that
        gives identical results (CPU bfloat16). Returns how many were packed."""
        from .packed_linear import try_pack

        count = 0
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                packed = try_pack(getattr(layer, name).weight)
                if packed is not None:
                    setattr(layer, name, packed)
                    count += 1
        self.head_proj = try_pack(self.output_weight)
        return count + (self.head_proj is not None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKV,
        meta: AttentionMetadata,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the packed batch; return logits only at ``logits_index`` (all tokens if None),
        which skips the vocabulary projection for every prompt token but the last."""
        x = self.embed_tokens(input_ids)
        rope = RopeAt.at(self.rotary, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, kv, meta)
        x = x + residual
        if logits_index is not None:
            x = x.index_select(0, logits_index)
        return self.compute_logits(x)

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama names, fusing q/k/v and gate/up."""
        t = lambda name: tensors[name]  # noqa: E731
        with torch.no_grad():
            self.embed_tokens.weight.copy_(t("model.embed_tokens.weight"))
            self.norm.weight.copy_(t("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(t("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.qkv_proj.weight.copy_(torch.cat([t(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                layer.o_proj.weight.copy_(t(p + "self_attn.o_proj.weight"))
                layer.gate_up_proj.weight.copy_(torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]))
                layer.down_proj.weight.copy_(t(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(t(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(t(p + "post_attention_layernorm.weight"))
