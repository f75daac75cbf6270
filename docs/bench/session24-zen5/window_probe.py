"""Probe (issue 24, accuracy): spend the recompute budget on one contiguous run of reused tokens, the one the
last prompt position attends to most at the check layer (a whole passage fixed), instead of the tokens
ranked by deviation x attention. Same row count as the setting's ratio. MODE=base|window, argv[1]: text|chat."""
import math, os, random, sys
import torch
from benchmarks import auto_reuse as ar
import kvmosaic.blend.blender as bl
from kvmosaic.blend.select import within_drift

MODE = os.environ.get("MODE", "window")
base_picker = bl.picker

def window_picker(opts, repaired):
    def pick(scores, attention):
        n = scores.numel()
        count = min(n, math.ceil(opts.ratio * n - 1e-9))
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        a = attention.float().cpu()
        sums = torch.nn.functional.conv1d(a[None, None], torch.ones(1, 1, count))[0, 0]  # windowed sums
        lo = int(sums.argmax())
        idx = torch.arange(lo, lo + count)
        extra = within_drift(scores.float().cpu(), idx, opts.max_drift)
        repaired.append(extra.numel())
        return torch.cat((idx, extra)).sort().values
    return pick

if MODE == "window":
    bl.picker = window_picker
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)
rng = random.Random(0)
chat = len(sys.argv) > 1 and sys.argv[1] == "chat"
ar.earlier_traffic(h, rng, chat, 4)
reqs = ar.rag_requests(int(os.environ.get("N", "48")), rng, h.tok, chat)
st = ar.measure(h, reqs, ar.FORCED, "x")
print(f"MODE {MODE} {'chat' if chat else 'text'}: acc full {st.mean('acc_full'):.3f} auto {st.mean('acc_auto'):.3f} "
      f"KL mean {st.mean('kl_mean'):.4f} first {st.mean('kl_first'):.4f} "
      f"ttft ratio {st.median('ttft_prefix') / st.median('ttft_auto'):.2f} reused {st.mean('doc_share'):.2f}")
