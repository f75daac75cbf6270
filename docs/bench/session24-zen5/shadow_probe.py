"""Issue 24 guard probe: how far the recompute moved the first answer token's distribution (the blend at the
setting's ratio against the same blend recomputing nothing past the check layer) as a per-request drift estimate.
Ranks requests by their measured KL to full prefill within a workload, and how many must be flagged to catch each
request above the bound."""
import dataclasses, random, statistics, sys
import benchmarks.auto_reuse as ar
from benchmarks.auto_reuse import spearman  # Pearson over ranks: no ties here


n_req = int(sys.argv[1]) if len(sys.argv) > 1 else 48
h = ar.Harness("bfloat16", 10.0, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)  # no fallback
print(ar.describe(), flush=True)
rng = random.Random(0)
base = h.opts
for form, chat in (("rag-text", False), ("rag-chat", True)):
    ar.earlier_traffic(h, rng, chat, 4)
    rows = []
    for r in ar.rag_requests(n_req, rng, h.tok, chat):
        full = h.run(False, r.prompt, None, ar.FORCED)
        answer = full.token_ids[:ar.FORCED]
        ref, _, _ = h.forced(False, r.prompt, r.warm, answer)
        lp, _, res = h.forced(True, r.prompt, r.warm, answer)
        h.opts = dataclasses.replace(base, ratio=0.0)
        lp0, _, _ = h.forced(True, r.prompt, r.warm, answer)
        h.opts = base
        k, k0, shadow = ar.kl(ref, lp), ar.kl(ref, lp0), ar.kl(lp, lp0)
        h.run(True, r.prompt, r.warm, 1)  # stores and folds as the benchmark's traffic does
        rows.append(dict(kl=float(k.mean()), kl1=float(k[0]), kl0=float(k0.mean()), drift=res.drift,
                         shadow1=float(shadow[0]), shadow_mean=float(shadow.mean())))
    print(f"{form}: {len(rows)} requests, KL mean {statistics.mean(x['kl'] for x in rows):.4f} "
          f"(nothing recomputed past the check layer: {statistics.mean(x['kl0'] for x in rows):.4f}), "
          f"above 0.03: {sum(x['kl'] > 0.03 for x in rows)}", flush=True)
    for est in ("drift", "shadow1", "shadow_mean"):
        xs = [x[est] for x in rows]
        bad = [x["kl"] > 0.03 for x in rows]
        order = sorted(range(len(rows)), key=lambda i: -xs[i])
        catch_all = max((pos + 1 for pos, i in enumerate(order) if bad[i]), default=0)
        print(f"  {est:11s} Spearman vs KL mean {spearman(xs, [x['kl'] for x in rows]):.2f}, vs KL first "
              f"{spearman(xs, [x['kl1'] for x in rows]):.2f}; flagging every bad request flags {catch_all} of {len(rows)}")
