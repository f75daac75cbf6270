"""Probe: rank by the attention of the prompt's last SPAN tokens (the question) instead of its last token alone."""
import os, random, sys, torch
from benchmarks import auto_reuse as ar
from kvmosaic.blend import forward as fw

SPAN = int(os.environ.get("SPAN", "16"))
def rows(q, k_pool, ctx_slots, p, start, scale):
    js = torch.arange(max(start, p - SPAN + 1), p + 1)
    qs = q[js - start].float()
    keys = k_pool.index_select(0, ctx_slots[: p + 1]).float()
    keys = keys.repeat_interleave(qs.shape[1] // keys.shape[1], dim=1)
    s = torch.einsum("rhd,mhd->rhm", qs, keys) * scale
    s = s.masked_fill(torch.arange(p + 1)[None, None, :] > js[:, None, None], float("-inf"))
    w = torch.softmax(s, dim=-1).mean(1).mean(0)
    out = torch.zeros(ctx_slots.numel(), dtype=torch.float32)
    out[: p + 1] = w.cpu()
    return out
if SPAN > 1:
    fw._attention_row = rows
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=int(os.environ.get("CL", "1")))
rng = random.Random(0)
chat = len(sys.argv) > 1 and sys.argv[1] == "chat"
ar.earlier_traffic(h, rng, chat, 4)
reqs = ar.rag_requests(48, rng, h.tok, chat)
st = ar.measure(h, reqs, ar.FORCED, "x")
print(f"SPAN {SPAN} {'chat' if chat else 'text'}: acc full {st.mean('acc_full'):.3f} auto {st.mean('acc_auto'):.3f} KL mean {st.mean('kl_mean'):.4f} first {st.mean('kl_first'):.4f} ttft ratio {st.median('ttft_prefix')/st.median('ttft_auto'):.2f} reused {st.mean('doc_share'):.2f}")
