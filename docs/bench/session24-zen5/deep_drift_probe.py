"""Issue 24 guard probe: does the deviation of the recomputed rows at deep layers (measured for free while
the blend recomputes them) rank requests by their measured KL better than the check layer's drift?"""
import random, statistics, sys
import torch
import benchmarks.auto_reuse as ar
from benchmarks.auto_reuse import spearman  # Pearson over ranks: no ties here
import kvmosaic.blend.blender as bl
from kvmosaic.blend.select import deviation

rec = {}
orig = bl.blend_forward

def patched(model, kv, token_ids, slots, start, reused, logits_positions, pick, check_layer=2):
    if pick is None:
        return orig(model, kv, token_ids, slots, start, reused, logits_positions, pick, check_layer)
    dev = kv.device
    r_idx = reused[start:].to(dev).nonzero().squeeze(1)
    cap = {}
    def pick2(scores, attn):
        idx = pick(scores, attn)
        cap["slots"] = slots[start:].to(dev)[r_idx[idx.to(dev)]]
        cap["check"] = scores[idx.to(scores.device)].float().mean().item() if idx.numel() else 0.0
        return idx
    layers = list(model.layers)
    per_layer = []
    for li, layer in enumerate(layers[check_layer + 1:], start=check_layer + 1):
        def wrap(x, rope, kvc, meta, rows=None, _layer=layer, _li=li, _orig=layer.hidden):
            s = cap.get("slots")
            if s is None or s.numel() == 0:
                return _orig(x, rope, kvc, meta, rows)
            k0, v0 = kvc.k[_li][s].clone(), kvc.v[_li][s].clone()
            out = _orig(x, rope, kvc, meta, rows)
            per_layer.append(deviation(kvc.k[_li][s], kvc.v[_li][s], k0, v0).mean().item())
            return out
        layer.hidden = wrap
    try:
        return orig(model, kv, token_ids, slots, start, reused, logits_positions, pick2, check_layer)
    finally:
        for layer in layers:
            layer.__dict__.pop("hidden", None)
        rec.update(check=cap.get("check", 0.0), deep=per_layer)

bl.blend_forward = patched


n_req = int(sys.argv[1]) if len(sys.argv) > 1 else 48
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)
print(ar.describe(), flush=True)
rng = random.Random(0)
for form, chat in (("rag-text", False), ("rag-chat", True)):
    ar.earlier_traffic(h, rng, chat, 4)
    rows = []
    for r in ar.rag_requests(n_req, rng, h.tok, chat):
        full = h.run(False, r.prompt, None, ar.FORCED)
        ref, _, _ = h.forced(False, r.prompt, r.warm, full.token_ids[:ar.FORCED])
        rec.clear()
        lp, verdict, res = h.forced(True, r.prompt, r.warm, full.token_ids[:ar.FORCED])
        k = ar.kl(ref, lp)
        h.run(True, r.prompt, r.warm, 1)  # the engine stores and folds as in the benchmark's traffic
        deep = rec.get("deep") or [0.0]
        amp = (statistics.mean(deep[-6:]) / rec["check"]) if rec.get("check") else 0.0
        rows.append(dict(kl=float(k.mean()), kl1=float(k[0]), drift=res.drift, attn=res.drift_attn,
                         deep_last=statistics.mean(deep[-6:]), deep_all=statistics.mean(deep),
                         amp_drift=res.drift * amp, amp_attn=res.drift_attn * amp))
    print(f"{form}: {len(rows)} requests, KL mean {statistics.mean(r['kl'] for r in rows):.4f}, "
          f"above 0.03: {sum(r['kl'] > 0.03 for r in rows)}")
    for est in ("drift", "attn", "deep_last", "deep_all", "amp_drift", "amp_attn"):
        xs = [r[est] for r in rows]
        bad = [r["kl"] > 0.03 for r in rows]
        # how many requests a bound on this estimate must send back to catch every bad one
        order = sorted(range(len(rows)), key=lambda i: -xs[i])
        catch_all = max((pos + 1 for pos, i in enumerate(order) if bad[i]), default=0)
        print(f"  {est:9s} Spearman vs KL mean {spearman(xs, [r['kl'] for r in rows]):.2f}, vs KL first "
              f"{spearman(xs, [r['kl1'] for r in rows]):.2f}; flagging every bad request flags {catch_all} of {len(rows)}")
