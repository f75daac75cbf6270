"""A/B in one process: automatic reuse's stores deferred past the first token (the engine now) against
done inside the step (before: SegmentReuse._defer patched to run the work at once and hold nothing).
rag-text, bfloat16, contexts 4 (seen 4), check layer 1, ratio 0.0625; alternating per request."""
import random, statistics, sys
from benchmarks import auto_reuse as ar
from kvmosaic.blend import engine_hook as eh
from kvmosaic.bench.machine import describe

print(describe(), flush=True)
deferred = eh.SegmentReuse._defer
def inline(self, cache, request_id, work):
    work()
h = ar.Harness("bfloat16", 0.03, blend_ratio=0.0625, auto_reuse_contexts=4, blend_check_layer=1)
rng = random.Random(0)
ar.earlier_traffic(h, rng, False, 4)
reqs = ar.rag_requests(48, rng, h.tok, False)
res = {"deferred": [], "inline": []}
for i, r in enumerate(reqs):
    for mode in (("deferred", "inline") if i % 2 else ("inline", "deferred")):
        eh.SegmentReuse._defer = deferred if mode == "deferred" else inline
        prefix = h.run(False, r.prompt, r.warm, 1)
        auto = h.run(True, r.prompt, r.warm, 1)
        res[mode].append((prefix.metrics["ttft"], auto.metrics["ttft"]))
for mode, v in res.items():
    p, a = statistics.median(x for x, _ in v), statistics.median(y for _, y in v)
    print(f"{mode:9s} prefix {p*1e3:6.1f} ms  auto {a*1e3:6.1f} ms  ratio {p/a:.2f}x  (n={len(v)})")
