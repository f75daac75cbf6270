"""A decode step in one call: every layer of a plain Llama-family model over a batch of
one-token sequences, in C (``kernels/decode_step.c``), instead of ~20 operator calls a layer, and
when every row is sampled the final norm and the LM head too (:meth:`FusedDecode.step`).

At decode on a CPU the weights stream from memory once per step and the arithmetic is small; what
kept a step at ~60% of the memory bandwidth was the operators' dispatch and a thread-pool wake-up
each (docs/ARCHITECTURE.md, "The fused decode step"). The fused step serves only what it computes
exactly as the layer-by-layer path does, up to float32 summation order in the projections:

* bfloat16 weights and pool on a CPU with AVX512-BF16 (the projections and the head on the tile unit
  where it has AMX: ``decode_tiles.amx_blocks``), or float32 on one with AVX-512 or AVX2 (the C
  function says so at its first call);
* plain Llama layers: no Q/K/V bias, no q/k norms, no sliding window or soft-capping, SiLU,
  full rotary, plain (or oneDNN-packed) projections, or a GGUF's Q4_1 ones (``quantization="gguf"``:
  the same sums as the layer path's Q4_1 kernel, ``kernels/q4_1_avx2.h`` in float32, ``q4_1_bf16.h`` in
  bfloat16; there at most ``quant_gguf.GEMV_MAX_ROWS`` rows, where the layer path runs that kernel and not
  a GEMM over weights rounded to bfloat16); not int8 ones;
* a step whose every token is a decode, with no shared-prefix (cascade) groups; on a CPU with AMX
  where the step's projections are not on the tile unit (``decode_tiles.amx_blocks``; the vector step,
  ``KVMOSAIC_DECODE_LAYOUT=rows``), at most ``AMX_MAX_ROWS`` of them (``packed_linear.amx_gemms``:
  oneDNN's tile GEMMs win past that).

Anything else runs the layer-by-layer path. ``KVMOSAIC_FUSED_DECODE=0`` turns it off (as
``KVMOSAIC_KERNELS=0`` turns off every kernel). A row's result does not depend on the batch, within
the batch sizes the step serves.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
from torch import nn

from . import decode_tiles, kernels
from .attention import AttentionMetadata, PagedKV
from .packed_linear import PackedLinear, amx_gemms
from .quant_gguf import GEMV_MAX_ROWS, Q4_1Linear, Q8_0Head

log = logging.getLogger("kvmosaic")

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
AMX_MAX_ROWS = 8
AMX_HEAD_MAX_ROWS = 4  # oneDNN's packed head after the step past this, where its GEMMs run on AMX tiles
KV_AHEAD_BYTES = 4 << 20  # K/V a thread's QKV projection asks for a layer, ahead of attention, where it pays


def kv_ahead_bytes() -> int:
    """K/V bytes a layer's QKV projection asks for ahead of attention (decode_step.c's ``kv_ahead``): on an
    AMD EPYC (Zen 4) the step 1.5-9% faster with them, on an AMX Xeon 5-30% slower (the more rows, the
    more; BENCHMARKS.md, issue 26, ninth session), so only where the weights are interleaved decode
    tiles: the AMD CPUs' layout (``decode_tiles.interleave``)."""
    return KV_AHEAD_BYTES if decode_tiles.interleave() else 0


def _projection_weight(module: nn.Module, dtype: torch.dtype, paired: bool = False) -> tuple[torch.Tensor, ...] | None:
    """What the C step reads of a projection, as its ``(w, d, m)`` pointers: the ``[out, in]``
    weight in ``dtype`` of a bias-free plain or packed projection, in the step's layout
    (model/decode_tiles.py: a packed projection keeps it instead of its rows, a plain one gets a
    copy where it is interleaved; d, m none), or the Q4_1 blocks of a GGUF projection (``quant_gguf.Q4_1Linear``:
    nibbles, scales, minima) in float32 or bfloat16; else None. ``paired``: the gate/up projection, whose
    halves the step reads paired (``decode_tiles.to_step_layout``)."""
    if type(module) is Q4_1Linear:
        ok = dtype in (torch.float32, torch.bfloat16) and module.gemv and module.qs.device.type == "cpu"
        return (module.qs, module.d, module.m) if ok else None
    if type(module) is nn.Linear and module.bias is not None:
        return None
    if type(module) not in (nn.Linear, PackedLinear):
        return None
    w = module.kept if type(module) is PackedLinear else module.weight
    if w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu" \
            or not decode_tiles.tileable(w, decode_tiles.step_layout(dtype)) or (paired and not decode_tiles.pairable(w)):
        return None
    if type(module) is PackedLinear:
        return (module.decode_weight(paired),)
    return (decode_tiles.to_step_layout(w, paired),)


def _step_head(model: nn.Module, dtype: torch.dtype, layout: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(final norm weight, head weight in the step's layout) where the step can end with the model's
    head after a plain RMSNorm in ``dtype``, in the projections' ``layout``: a ``decode_tiles.AmxLinear``
    where they are on the tile unit, a ``decode_tiles.TiledLinear`` (``pack_linears'`` choice where
    oneDNN's GEMMs are not on AMX tiles), or oneDNN's packed head where the step reads
    rows, whose kept rows are then the step's layout (on an AMX Xeon the head in the step read its
    56 MB in 1.8 ms, and a batch-1 step took 12.3-12.8 against 13.2-13.3 ms with oneDNN's head after
    it; at 4 rows 2% faster, at 8 3% slower: ``AMX_HEAD_MAX_ROWS``; BENCHMARKS.md, issue 26, eighth
    session). Else None."""
    from .llama import RMSNorm

    head, norm = model.head_proj, model.norm
    if type(norm) is not RMSNorm or norm.weight.dtype != dtype or norm.eps != model.config.rms_norm_eps:
        return None  # the step norms with the layers' eps
    if type(head) is decode_tiles.AmxLinear:
        return (norm.weight.detach().contiguous(), head.blocks) if layout == decode_tiles.AMX else None
    if layout == decode_tiles.AMX:
        return None
    if type(head) is decode_tiles.TiledLinear and head.tiles.dtype == dtype:
        return norm.weight.detach().contiguous(), head.tiles
    if type(head) is PackedLinear and decode_tiles.head_layout() == decode_tiles.ROWS and head.kept.dtype == dtype \
            and head.kept.is_contiguous() and decode_tiles.tileable(head.kept, decode_tiles.ROWS):
        return norm.weight.detach().contiguous(), head.kept
    return None


class FusedDecode:
    """The fused step for one model; build with :meth:`for_model` (None where it does not serve)."""

    def __init__(self, model: nn.Module, weights: list[torch.Tensor], dtype: torch.dtype,
                 layout: int | None = None) -> None:
        cfg = model.config
        self.model, self.dtype = model, dtype
        # the projections' layout (decode_tiles.ROWS, TILES or AMX): the process's (step_layout), in
        # which the weights were converted; a head in the step is in the same layout
        self.layout = decode_tiles.step_layout(dtype) if layout is None else layout
        self.kv_ahead = kv_ahead_bytes()
        # [layer][(w, d, m) of qkv, o, gate_up, down, norm1, norm2]: the C step's pointers, kept alive
        self.weights = weights
        # (final norm weight, head weight in the step's layout) where the step can end with the head
        # (_step_head), the logits then out of the same C call (see step); else None
        self.head = _step_head(model, dtype, self.layout)
        self.shape = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
        self.eps, self.scale = float(cfg.rms_norm_eps), float(model.layers[0].scale)
        self._pointers: tuple[tuple[int, ...], ctypes.Array] | None = None  # (pool addresses, layer pointers)
        # Where oneDNN's GEMMs run on AMX tiles the layers' path is faster than the vector step past a
        # few rows (a 700-token context's step: 25 against 29 ms at 6 rows, a tie at 8, 64 against 50 at
        # 16, 99-115 against 77-81 at 32; 2-core AMX Xeon): larger decode batches take it, and past a few
        # rows oneDNN's head after the step. The step on the tile unit serves any batch, its head too.
        vector_beside_amx = amx_gemms(dtype) and self.layout != decode_tiles.AMX
        caps = [AMX_MAX_ROWS] if vector_beside_amx else []
        # In bfloat16 the layer path computes Q4_1 projections past GEMV_MAX_ROWS rows by a GEMM over the weights
        # rounded to bfloat16, not by the kernel the step shares: the step serves no more rows than the kernel
        if dtype == torch.bfloat16 and any(type(getattr(layer, name)) is Q4_1Linear
                                           for layer in model.layers for name in PROJECTIONS):
            caps.append(GEMV_MAX_ROWS)
        self.max_rows = min(caps, default=None)
        self.head_max_rows = AMX_HEAD_MAX_ROWS if vector_beside_amx else None  # rows the head in the step serves

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedDecode | None:
        from .llama import DecoderLayer, RMSNorm

        if os.environ.get("KVMOSAIC_FUSED_DECODE", "1") == "0" or kernels.decode_step_library() is None:
            return None
        cfg = model.config
        if cfg.traits.activation != "silu" or cfg.traits.final_softcap is not None or len(model.rotaries) != 1 \
                or model.rotary.inv_freq.numel() * 2 != cfg.head_dim:
            return None
        dtype = model.layers[0].input_layernorm.weight.dtype
        if dtype not in decode_tiles.DTYPES:
            return None
        weights = []
        for layer in model.layers:
            if type(layer) is not DecoderLayer or layer.qkv_bias is not None or layer.q_norm is not None \
                    or layer.window is not None or layer.softcap is not None or layer.scale != model.layers[0].scale:
                return None
            projections = [_projection_weight(getattr(layer, name), dtype, paired=name == "gate_up_proj")
                           for name in PROJECTIONS]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if any(p is None for p in projections) or any(type(n) is not RMSNorm or n.weight.dtype != dtype
                                                           for n in norms):
                return None
            pointers = [t for p in projections for t in (*p, None, None)[:3]]
            weights.append([*pointers, *(n.weight.detach().contiguous() for n in norms)])
        fused = cls(model, weights, dtype)
        rc = fused._run(None, 0, *[None] * 6, max_len=1)
        if rc != 0:
            log.info("no fused decode step here (code %d): the layer-by-layer path runs", rc)
            return None
        return fused

    def serves(self, kv: PagedKV, meta) -> bool:
        """Whether this step is one the fused path computes: decodes only (at most ``max_rows``), a pool
        in the model's dtype."""
        d = meta.decode if isinstance(meta, AttentionMetadata) else None
        return (d is not None and not meta.prefills and not d.shared and d.lens is not None
                and d.token_index.numel() == meta.slot_mapping.numel()  # every token a decode, in order
                and (self.max_rows is None or d.token_index.numel() <= self.max_rows)
                and kv.k[0].dtype == self.dtype and kv.k[0].is_contiguous())

    def _layer_pointers(self, kv: PagedKV) -> ctypes.Array:
        """The C function's per-layer pointers for this pool, rebuilt when any layer's K or V moved.
        Keyed on every layer's addresses: the model is shared by a process's engines, and a new
        engine's pool can begin where a freed one of another size began (tests/test_fused_decode.py)."""
        addresses = tuple(t.data_ptr() for pair in zip(kv.k, kv.v) for t in pair)
        if self._pointers is None or self._pointers[0] != addresses:
            flat = [None if t is None else t.data_ptr()
                    for layer, (k, v) in zip(self.weights, zip(kv.k, kv.v)) for t in (*layer, k, v)]
            self._pointers = (addresses, (ctypes.c_void_p * len(flat))(*flat))
        return self._pointers[1]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden state ``[B, hidden]`` (before the final norm) of the decode tokens whose
        embeddings are ``x``; None where the C function declines (the caller runs the layers)."""
        return self._call(x, positions, kv, meta, None)

    def step(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV, meta: AttentionMetadata,
             logits_index: torch.Tensor | None) -> torch.Tensor | None:
        """Float32 logits at ``logits_index`` (every row when None) of the decode tokens whose
        embeddings are ``x``; None where the C function declines. When every row is wanted and the
        head is the step's (``_step_head``; on AMX at most ``head_max_rows`` rows), the final norm
        and the head run in the same C call (no return to Python, no second parallel region): the
        same values as :meth:`__call__` then :meth:`logits`, bit for bit."""
        if self.head is not None and (logits_index is None or logits_index.numel() == x.shape[0]) \
                and (self.head_max_rows is None or x.shape[0] <= self.head_max_rows):
            return self._call(x, positions, kv, meta, self.head)  # every row: the runner asks for rows ascending
        hidden = self(x, positions, kv, meta)
        if hidden is None:
            return None
        return self.logits(hidden if logits_index is None else hidden.index_select(0, logits_index))

    def _call(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKV, meta: AttentionMetadata,
              head: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """The C step: the final hidden state, or with ``head`` (final norm weight, head tiles) the
        float32 logits of every row; None where it declines."""
        d = meta.decode
        stream = x.contiguous().clone()
        cos, signed_sin = (t.contiguous() for t in self.model.rotary.rows(positions))
        slot_mapping, ctx_slots, lens = (t.to(torch.int64).contiguous() for t in (meta.slot_mapping, d.ctx_slots, d.lens))
        logits = None if head is None else torch.empty(stream.shape[0], head[1].shape[0], dtype=torch.float32)
        rc = self._run(self._layer_pointers(kv), stream.shape[0], stream, cos, signed_sin, slot_mapping, ctx_slots, lens,
                       max_len=ctx_slots.shape[1], head=head, logits=logits)
        if rc != 0:
            log.warning("fused decode step failed (code %d): this step runs layer by layer", rc)
            return None
        return stream if logits is None else logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states ``[B, hidden]``: the model's own head, which is
        the C product over decode tiles where it serves (``decode_tiles.TiledLinear``, set by
        ``pack_linears``: every row alone, as the layers' projections), or with
        ``quantization="gguf"`` the Q8_0 head on its blocks, every row alone; where oneDNN's packed
        head is the model's and the step computes its rows (``_step_head``), the step's C product
        up to ``head_max_rows`` rows, so that a row's logits are the step's head's."""
        if type(self.model.head_proj) is Q8_0Head:
            return self.model.head_proj.rows(self.model.norm(hidden).contiguous())
        if self.head is not None and type(self.model.head_proj) is PackedLinear \
                and (self.head_max_rows is None or hidden.shape[0] <= self.head_max_rows):
            return decode_tiles.rows_product(self.head[1], self.model.norm(hidden)).float()
        return self.model.compute_logits(hidden)

    def _run(self, pointers, batch: int, *tensors: torch.Tensor | None, max_len: int,
             head: tuple[torch.Tensor, torch.Tensor] | None = None, logits: torch.Tensor | None = None) -> int:
        layers, hidden, inter, heads, kv_heads, dim = self.shape
        norm, tiles = head if head is not None else (None, None)
        return kernels.decode_step_library().decode_step(
            pointers, layers, hidden, inter, heads, kv_heads, dim, self.eps, self.scale,
            *(None if t is None else t.data_ptr() for t in tensors), max_len, batch,
            *(None if t is None else t.data_ptr() for t in (norm, tiles)), 0 if tiles is None else tiles.shape[0],
            None if logits is None else logits.data_ptr(), self.layout, self.kv_ahead, int(self.dtype == torch.bfloat16),
            torch.get_num_threads())
