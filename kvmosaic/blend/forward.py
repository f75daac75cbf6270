"""One prompt, one selective-recompute forward pass over the paged pool.

Before the call, the pool holds, at the prompt's slots: exact KV for tokens ``< start`` (a
prefix hit) and, at every layer, reused KV for the tokens flagged ``reused`` (already moved
to their positions). The pass then, for the tokens from ``start`` on:

1. runs layers ``< check_layer`` on every token (their KV becomes exact);
2. at ``check_layer`` computes fresh KV for every token, writes it, and scores each reused
   token by its deviation from the reused KV; ``pick`` chooses which reused tokens to
   recompute, from those scores and the first logits position's attention to each token
   there (fresh KV). Non-reused tokens are always recomputed;
3. runs the chosen tokens (and only those) through the remaining layers; each writes its
   fresh KV and attends, causally by position, to the whole prompt's KV in the pool.

With ``pick=None`` nothing reused is recomputed and step 1-2 are skipped (``shift``). When
every token is recomputed the result is a full prefill. Afterwards the pool holds the final
KV of every prompt token, and decoding can continue as after any prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv.paged import PagedKVCache
from ..model.attention import AttentionMetadata, PrefillSpan, paged_attention
from ..model.llama import LlamaForCausalLM, QueryRows
from ..model.rotary import RopeAt
from .select import deviation

# (scores [R], attention [R]: the first logits position's attention to each at the check layer)
# -> chosen indices into them
Picker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BlendOutput:
    logits: torch.Tensor  # [len(logits_positions), vocab] float32
    recomputed: torch.Tensor  # [N] bool: tokens whose KV was computed in this pass
    # [N] float: each reused token's deviation score at the check layer (0 elsewhere); None
    # when nothing was scored (``pick=None``)
    deviation: torch.Tensor | None = None
    # [N] float: the first logits position's attention over the context at the check layer
    # (fresh KV, mean over heads; 0 past that position); None when nothing was scored
    attention: torch.Tensor | None = None


def _meta(slots: torch.Tensor, q_pos: torch.Tensor, ctx_slots: torch.Tensor) -> AttentionMetadata:
    """Queries at positions ``q_pos`` (ascending, distinct) attend causally to the context."""
    n = ctx_slots.numel()
    is_tail = q_pos.numel() > 0 and int(q_pos[0]) == n - q_pos.numel()  # the context's last tokens
    if is_tail:
        return AttentionMetadata(slots, [PrefillSpan(0, q_pos.numel(), ctx_slots, None)])
    mask = torch.arange(n, device=q_pos.device)[None, :] <= q_pos[:, None]
    return AttentionMetadata(slots, [PrefillSpan(0, q_pos.numel(), ctx_slots, mask, q_pos)])


@torch.inference_mode()
def blend_forward(
    model: LlamaForCausalLM,
    kv: PagedKVCache,
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    start: int,
    reused: torch.Tensor,
    logits_positions: torch.Tensor,
    pick: Picker | None,
    check_layer: int = 2,
) -> BlendOutput:
    """``token_ids``, ``slots``, ``reused``: ``[N]`` for the whole prompt. Positions in
    ``logits_positions`` must not be reused (their hidden states are needed)."""
    dev = kv.device
    n = token_ids.numel()
    pos = torch.arange(start, n, device=dev)
    region_slots, ctx_slots = slots[start:].to(dev), slots.to(dev)
    reused = reused[start:].to(dev)
    assert not reused[logits_positions.to(dev) - start].any(), "logits positions must be recomputed"
    x = model.embed_tokens(token_ids[start:].to(dev))
    rope = RopeAt.at(model.rotary, pos)
    layers = list(model.layers)
    dev_full = attn_row = None
    if pick is None:
        sel = (~reused).nonzero().squeeze(1)
        first = 0
    else:
        full = _meta(region_slots, pos, ctx_slots)
        for layer in layers[:check_layer]:
            x = layer.hidden(x, rope, kv, full)
        layer = layers[check_layer]
        q, k, v = layer.qkv(layer.input_layernorm(x), rope)
        r_idx = reused.nonzero().squeeze(1)
        r_slots = region_slots[r_idx]
        scores = deviation(k[r_idx], v[r_idx], kv.k[check_layer][r_slots], kv.v[check_layer][r_slots])
        kv.write(check_layer, region_slots, k, v)
        attn_row = _attention_row(q, kv.k[check_layer], ctx_slots, int(logits_positions[0]), start, layer.scale)
        r_pos = (r_idx + start).cpu()
        chosen = r_idx[pick(scores, attn_row[r_pos]).to(dev)]
        dev_full = torch.zeros(n, dtype=torch.float32)
        dev_full[r_pos] = scores.float().cpu()
        sel = torch.cat(((~reused).nonzero().squeeze(1), chosen)).sort().values
        attn = paged_attention(q[sel], kv.k[check_layer], kv.v[check_layer],
                               _meta(region_slots[sel], pos[sel], ctx_slots), layer.scale)
        x = layer.finish(x[sel], attn)
        first = check_layer + 1
    if pick is None:
        x = x[sel]
    meta = _meta(region_slots[sel], pos[sel], ctx_slots)
    rope = rope.select(sel)
    where = torch.searchsorted(pos[sel], logits_positions.to(dev))
    read = torch.unique(where)
    for layer in layers[first:]:
        rows = QueryRows.of(meta, read, x.shape[0]) if layer is layers[-1] else None
        x = layer.hidden(x, rope, kv, meta, rows)
        if rows is not None:  # x holds the logits rows alone
            where = torch.searchsorted(read, where)
    logits = model.compute_logits(x.index_select(0, where))
    recomputed = torch.zeros(n, dtype=torch.bool, device=dev)
    recomputed[pos[sel]] = True
    return BlendOutput(logits, recomputed.cpu(), dev_full, attn_row)


def _attention_row(q: torch.Tensor, k_pool: torch.Tensor, ctx_slots: torch.Tensor, p: int, start: int,
                   scale: float) -> torch.Tensor:
    """Position ``p``'s attention weights over positions ``0..p`` (its query ``q[p - start]``
    against the pool's keys), averaged over query heads; ``[N]`` on the CPU, 0 past ``p``."""
    qp = q[p - start].float()  # [Hq, D]
    keys = k_pool.index_select(0, ctx_slots[: p + 1]).float()  # [p+1, Hkv, D]
    keys = keys.repeat_interleave(qp.shape[0] // keys.shape[1], dim=1)
    w = torch.softmax(torch.einsum("hd,mhd->hm", qp, keys) * scale, dim=-1).mean(0)
    out = torch.zeros(ctx_slots.numel(), dtype=torch.float32)
    out[: p + 1] = w.cpu()
    return out
