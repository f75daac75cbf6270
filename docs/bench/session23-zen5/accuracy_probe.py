import random, sys
from benchmarks import auto_reuse as ar
from benchmarks import auto_reuse_workloads as aw
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)
rng = random.Random(0)
ar.earlier_traffic(h, rng, False, 4)
reqs = ar.rag_requests(24, rng, h.tok, False)
st = ar.measure(h, reqs, ar.FORCED, "x")
for i, r in enumerate(reqs):
    print(i, r.answer, st.rows["acc_full"][i], st.rows["acc_auto"][i], f"{st.rows['kl_mean'][i]:.4f}", f"{st.rows['kl_first'][i]:.4f}", r.docs.index(aw.POOL[aw.doc_with(r.answer)]))
