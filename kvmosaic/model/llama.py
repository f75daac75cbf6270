"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) that reads and
writes its KV through the paged pool. The other families (Qwen2/3, Mistral, Phi-3, Gemma 2/3)
run the same decoder, switched by ``config.traits`` (``model/families.py``); Gemma's layer
(``model/gemma.py``) overrides only its norms and where they sit.

Q/K/V and gate/up projections are fused into one weight each, so a layer is four GEMMs over
the whole packed batch. Numerics follow Hugging Face's Llama (norms in float32, RoPE tables
in float32), so float32 logits match transformers on the same weights.

The layers pass the residual stream beside the sublayer output, as vLLM's models do, so that
each RMSNorm adds the residual in the same pass (``model/kernels``, on a CPU with a C compiler;
torch operators otherwise, with the same roundings).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, prompt_gemms
from .attention import AttentionMetadata, PagedKV, paged_attention
from .config import ModelConfig
from .fused_decode import FusedDecode
from .packed_linear import PackedLinear
from .rotary import RopeAt, RotaryEmbedding
from .softcap import softcap_paged_attention
from .window import GroupedMetadata, layer_view

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


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


@dataclass(frozen=True)
class QueryRows:
    """The rows of a step whose layer output is read (``index``, ascending, into the flat batch)
    and the step's attention for them alone (:meth:`AttentionMetadata.select_queries`): the last
    layer runs past its K/V write for these rows only (docs/ARCHITECTURE.md, invariant 11)."""

    index: torch.Tensor
    meta: AttentionMetadata

    @classmethod
    def of(cls, meta: AttentionMetadata, index: torch.Tensor | None, num_rows: int) -> QueryRows | None:
        """``index``'s rows where they are fewer than the step's and the metadata can be cut to
        them; None (every row runs) otherwise."""
        if index is None or index.numel() >= num_rows:
            return None
        cut = meta.select_queries(index)
        return None if cut is None else cls(index, cut)


class DecoderLayer(nn.Module):
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        traits, norm = cfg.traits, self.norm_class
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.split_qk_v = (q + kv, kv)
        self.scale = traits.attn_scale or cfg.head_dim**-0.5
        # Family switches (families.Traits); biases kept apart so packed/int8 projections stay bias-free
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv)) if traits.qkv_bias else None
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.act = ACTIVATIONS[traits.activation]
        self.window, self.softcap = traits.window(layer_idx), traits.attn_softcap
        self.rope_index = 0  # which of the model's RoPE tables (set by the model)

    def qkv(self, h: torch.Tensor, rope: RopeAt):
        """Normed input -> rotated q ``[T, H, D]``, rotated k and v ``[T, Hkv, D]`` (q and k are
        rotated together: one pass per layer, not two)."""
        return self._rotated(self._projected(h), rope)

    def qkv_stored(self, h: torch.Tensor, rope: RopeAt, kv: PagedKV, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`qkv` with k and v written to the pool at ``slots``; returns q. The rotation and
        the write are one pass over the rows where the kernel serves (``RopeAt.apply_and_store_``)."""
        qkv = self._projected(h)
        if self.q_norm is None and rope.apply_and_store_(qkv, self.num_heads, self.num_kv_heads, kv.k[self.layer_idx],
                                                         kv.v[self.layer_idx], slots):
            return qkv[:, : self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)
        q, k, v = self._rotated(qkv, rope)
        kv.write(self.layer_idx, slots, k, v)
        return q

    def _projected(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        return qkv if self.qkv_bias is None else qkv + self.qkv_bias

    def _rotated(self, qkv: torch.Tensor, rope: RopeAt):
        qk = qkv[:, : self.split_qk_v[0]].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = rope.apply_(qk).split((self.num_heads, self.num_kv_heads), dim=1)
        return q, k, qkv[:, self.split_qk_v[0] :].view(-1, self.num_kv_heads, self.head_dim)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        fused = self.act is F.silu and h.dim() == 2 and kernels.elementwise_available(h)
        if fused and type(self.gate_up_proj) is PackedLinear:
            act = self.gate_up_proj.silu_product(h)  # on the tile unit: the two lines below in one pass
            if act is not None:
                return self.down_proj(act)
        gate_up = self.gate_up_proj(h)
        if fused:
            return self.down_proj(kernels.silu_mul(gate_up))  # one pass, rounded as the lines below
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def attend(self, q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the pool; ``meta`` is this layer's view (window applied, see
        :meth:`LlamaForCausalLM.forward`)."""
        k, v = kv.k[self.layer_idx], kv.v[self.layer_idx]
        if self.softcap is not None:
            return softcap_paged_attention(q, k, v, meta, self.scale, self.softcap)
        return paged_attention(q, k, v, meta, self.scale)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeAt, kv: PagedKV,
                meta: AttentionMetadata, rows: QueryRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer over the residual stream. The hidden state is ``x + residual`` (``x`` alone
        when ``residual`` is None, e.g. at the first layer); ``residual`` is updated in place.
        Returns (sublayer output, stream), whose sum is the layer's hidden state. With ``rows``,
        every row's K and V are written but the rest of the layer runs for those rows only, and
        only theirs are returned (the last layer, where no other row's output is read)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        q = self.qkv_stored(h, rope, kv, meta.slot_mapping)
        if rows is not None:
            q, residual, meta = q.index_select(0, rows.index), residual.index_select(0, rows.index), rows.meta
        h = self.post_attention_layernorm(self.o_proj(self.attend(q, kv, meta).flatten(1)), residual)
        return self.mlp(h), residual

    def hidden(self, x: torch.Tensor, rope: RopeAt, kv: PagedKV, meta: AttentionMetadata,
               rows: QueryRows | None = None) -> torch.Tensor:
        """The layer from a hidden state to the next (``x`` left as it is): the layer-by-layer
        API of segment reuse (``blend/forward.py``)."""
        out, residual = self(x.clone(), None, rope, kv, meta, rows)
        return out if residual is None else out + residual

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """From a layer's attention output to its hidden state, ``x`` being the layer's input
        hidden state (left as it is)."""
        residual = x.clone()
        h = self.post_attention_layernorm(self.o_proj(attn.flatten(1)), residual)
        return residual + self.mlp(h)


def _rows_read(logits_index: torch.Tensor | None, hidden_index: torch.Tensor | None) -> torch.Tensor | None:
    """The rows whose last-layer output the step reads, ascending; None: every row."""
    if logits_index is None:
        return None
    return torch.unique(logits_index if hidden_index is None else torch.cat((logits_index, hidden_index)))


def decoder_layer(cfg: ModelConfig, layer_idx: int) -> DecoderLayer:
    """The family's layer: Gemma's where its norms are Gemma's, else the Llama layer."""
    if cfg.traits.gemma_norms:
        from .gemma import GemmaDecoderLayer

        return GemmaDecoderLayer(cfg, layer_idx)
    return DecoderLayer(cfg, layer_idx)


def _take(param: torch.Tensor, value: torch.Tensor) -> None:
    """Load ``value`` into ``param``: adopted as its storage where it already is a contiguous
    tensor of the same dtype and device (a loader's fresh tensor: no second copy of the weights
    to fault in), copied otherwise."""
    if value.shape != param.shape:
        raise ValueError(f"a weight of shape {tuple(value.shape)} where the model has {tuple(param.shape)}")
    if value.dtype == param.dtype and value.device == param.device and value.is_contiguous():
        param.data = value
    else:
        param.copy_(value)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # uninitialised: the weights are loaded over it (build_model), and a random init is the
        # costliest step of building the model on the meta device (~1.4 s, torch's first normal_ there)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.layers[0].norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        # One RoPE table per distinct RoPE (Gemma 3: local and global layers differ)
        ropes = [cfg.traits.rope(i, cfg.rope_theta) for i in range(cfg.num_layers)]
        self.ropes = list(dict.fromkeys(ropes))
        self.rotaries = nn.ModuleList(RotaryEmbedding(cfg.head_dim, r, cfg.max_position_embeddings) for r in self.ropes)
        for layer, rope in zip(self.layers, ropes):
            layer.rope_index = self.ropes.index(rope)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_proj: nn.Module | None = None  # replaces the plain head product: pack_linears, quant.py
        self._fused: FusedDecode | None | bool = False  # False: not decided yet (see fused_decode)

    @property
    def rotary(self) -> RotaryEmbedding:
        """The RoPE table of the first full-attention layer (the only table, but for Gemma 3)."""
        full = next((layer for layer in self.layers if layer.window is None), self.layers[0])
        return self.rotaries[full.rope_index]

    def reset_rotary(self, device: torch.device | str, max_positions: int | None = None) -> None:
        """Recompute the RoPE tables (buffers not in the weights) on ``device``, in float32, for
        ``max_positions`` (default: the model's; a shorter context picks longrope's short set)."""
        for rotary, rope in zip(self.rotaries, self.ropes):
            rotary.__init__(self.config.head_dim, rope, max_positions or self.config.max_position_embeddings)
            rotary.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled where the family scales them (Gemma: sqrt(hidden), rounded
        to the weights' dtype as transformers does)."""
        x = self.embed_tokens(input_ids)
        scale = self.config.traits.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32 logits (capped where the family caps them)."""
        head = self.head_proj
        h = self.norm(hidden)
        logits = (head(h) if head is not None else F.linear(h, self.output_weight)).float()
        cap = self.config.traits.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def pack_linears(self) -> int:
        """Swap every projection for a oneDNN pre-packed one where that gives the same results
        (CPU bfloat16: identical; float32: to rounding, see packed_linear.py), and the LM head
        for the C product over decode tiles (``decode_tiles.TiledLinear``: a few rows at the
        memory bandwidth, each row on its own), or a packed one where that does not serve or
        oneDNN's GEMM runs on AMX tiles (as fast at one row, 7x faster at 32: ``amx_gemms``) —
        there, where the fused step's projections are on the tile unit, its tile product
        (``decode_tiles.AmxLinear``: the step's head at every batch it serves, each row on its own).
        Returns how many were swapped."""
        from .decode_tiles import try_amx, try_tiled
        from .packed_linear import amx_gemms, try_pack

        count = 0
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                packed = try_pack(getattr(layer, name).weight)
                if packed is not None:
                    setattr(layer, name, packed)
                    count += 1
        tiled = try_amx(self.output_weight) if amx_gemms(self.output_weight.dtype) else try_tiled(self.output_weight)
        self.head_proj = tiled or try_pack(self.output_weight)
        self._fused = False
        return count + (self.head_proj is not None)

    def fused_decode(self, kv: PagedKV, meta) -> FusedDecode | None:
        """The one-call decode step where it serves this model and step (``fused_decode.py``);
        decided at the first step, when the projections are final."""
        if self._fused is False:
            self._fused = FusedDecode.for_model(self)
            prompt_gemms.choose(self)  # the step's layout is final now: the tile GEMM's weights
        return self._fused if self._fused is not None and self._fused.serves(kv, meta) else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKV,
        meta: AttentionMetadata | GroupedMetadata,
        logits_index: torch.Tensor | None = None,
        hidden_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the packed batch; return logits only at ``logits_index`` (all tokens if None),
        which skips the vocabulary projection for every prompt token but the last. With
        ``hidden_index``, also the last layer's hidden states at those rows (before the final
        norm: :meth:`compute_logits` takes them), as ``(logits, hidden)``: prompt
        log-probabilities ask the head of every prompt row, in slices (engine/prompt_logprobs.py)."""
        x = self.embed(input_ids)
        fused = self.fused_decode(kv, meta) if hidden_index is None else None
        logits = fused.step(x, positions, kv, meta, logits_index) if fused is not None else None
        if logits is not None:
            return logits
        ropes = [RopeAt.at(rotary, positions) for rotary in self.rotaries]
        views: dict[tuple, AttentionMetadata] = {}  # per (group, window), built once per step
        bands: dict = {}  # band masks, shared by the groups (positions only)
        residual = None
        grouped = isinstance(meta, GroupedMetadata)
        read = _rows_read(logits_index, hidden_index)
        for layer in self.layers:
            m = meta.for_layer(layer.layer_idx) if grouped else meta
            if layer.window is not None or layer.softcap is not None:
                key = (id(m), layer.window)
                if key not in views:
                    views[key] = layer_view(m, layer.window, bands)
                m = views[key]
            rows = QueryRows.of(m, read, x.shape[0]) if layer is self.layers[-1] else None
            x, residual = layer(x, residual, ropes[layer.rope_index], kv, m, rows)
            if rows is not None:  # x holds the rows read, in order
                logits_index, hidden_index = (None if i is None else torch.searchsorted(read, i)
                                              for i in (logits_index, hidden_index))
        if residual is not None:
            x = x + residual
        hidden = None if hidden_index is None else x.index_select(0, hidden_index)
        if logits_index is not None:
            x = x.index_select(0, logits_index)
        return self.compute_logits(x) if hidden is None else (self.compute_logits(x), hidden)

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names, fusing q/k/v and gate/up (or taking them fused, as Phi-3
        stores them); every norm of a layer is read by its own name."""
        t = lambda name: tensors[name]  # noqa: E731

        def fused(name: str, parts: list[str]) -> torch.Tensor:
            return t(name) if name in tensors else torch.cat([t(n) for n in parts])

        with torch.no_grad():
            _take(self.embed_tokens.weight, t("model.embed_tokens.weight"))
            _take(self.norm.weight, t("model.norm.weight"))
            if self.lm_head is not None:
                _take(self.lm_head.weight, t("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a, m = p + "self_attn.", p + "mlp."
                _take(layer.qkv_proj.weight, fused(a + "qkv_proj.weight", [a + f"{n}_proj.weight" for n in "qkv"]))
                if layer.qkv_bias is not None:
                    _take(layer.qkv_bias, torch.cat([t(a + f"{n}_proj.bias") for n in "qkv"]))
                _take(layer.o_proj.weight, t(a + "o_proj.weight"))
                _take(layer.gate_up_proj.weight, fused(m + "gate_up_proj.weight", [m + "gate_proj.weight", m + "up_proj.weight"]))
                _take(layer.down_proj.weight, t(m + "down_proj.weight"))
                for name, module in layer.named_children():
                    if isinstance(module, RMSNorm):
                        _take(module.weight, t((a if name in ("q_norm", "k_norm") else p) + name + ".weight"))
