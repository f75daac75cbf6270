import random, sys, torch
from benchmarks import auto_reuse as ar
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
chat = len(sys.argv) > 2 and sys.argv[2] == "chat"
ar.earlier_traffic(h, rng, chat, 4)
reqs = ar.rag_requests(48, rng, h.tok, chat)
for i, r in enumerate(reqs):
    full = h.run(False, r.prompt, None, ar.FORCED)
    ref, _, _ = h.forced(False, r.prompt, r.warm, full.token_ids[:ar.FORCED])
    lp, verdict, res = h.forced(True, r.prompt, r.warm, full.token_ids[:ar.FORCED])
    auto = h.run(True, r.prompt, r.warm, ar.FORCED)
    k = ar.kl(ref, lp)
    t2a = lp[0].topk(2).values; t2f = ref[0].topk(2).values
    ent = -(lp[0].exp() * lp[0]).sum()
    print(i, int(r.answer.lower() in full.text.lower()), int(r.answer.lower() in auto.text.lower()),
          f"klfirst {float(k[0]):.4f} klmean {float(k.mean()):.4f} margin_auto {float(t2a[0]-t2a[1]):.3f} margin_full {float(t2f[0]-t2f[1]):.3f} entropy_auto {float(ent):.3f} drift {res.drift:.4f}", flush=True)
