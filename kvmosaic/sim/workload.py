"""Synthetic traffic for the simulator: a mix of three shapes, at a rate that loads the
cluster to a chosen utilisation.

* ``chat``: a tenant (Zipf popularity) sends its system prompt (500-4,000 tokens) + a question;
* ``session``: a multi-turn conversation of a tenant; turn k's prompt is turn k-1's prompt,
  its answer (the tokens it will generate) and a new user message, so generated tokens are
  reused; turns are spaced by a think time (pre-scheduled, not waiting on the previous answer);
* ``rag``: a fixed RAG system prompt + 3 documents drawn (Zipf) from a shared pool, in random
  order, + a question; shared namespace (no salt), so only prefixes in the same order hit.

Tenants' requests carry their tenant as cache salt (as the server derives it from the API key).
Token ids are random, seeded: the same arguments give the same workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import cost

VOCAB = 49_152


@dataclass
class SimRequest:
    request_id: str
    arrival: float  # seconds
    prompt: list[int]
    output: list[int]  # the tokens it will generate (known upfront, so sessions can reuse them)
    salt: str | None
    kind: str
    # filled by the simulation
    replica: str | None = None
    reason: str | None = None
    cached: int = 0
    predicted: int = 0
    first_token: float | None = None
    finished: float | None = None
    hashes: list[bytes] = field(default_factory=list, repr=False)


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def make_workload(num_replicas: int, requests_per_replica: int = 40, utilisation: float = 0.7,
                  tenants_per_replica: float = 3.0, zipf_s: float = 1.1, seed: int = 0,
                  mix: tuple[float, float, float] = (0.5, 0.3, 0.2), ref_hit: float = 0.5) -> list[SimRequest]:
    """``ref_hit``: the fraction of prompt tokens assumed cached when sizing the arrival rate
    (the rate is set so that work at that hit rate is ``utilisation`` of the cluster)."""
    rng = np.random.default_rng(seed)
    def toks(n: float) -> list[int]:
        return rng.integers(3, VOCAB, int(n)).tolist()

    num_tenants = max(4, int(tenants_per_replica * num_replicas))
    systems = [toks(rng.integers(500, 4001)) for _ in range(num_tenants)]
    tenant_w = _zipf_weights(num_tenants, zipf_s)
    rag_system = toks(300)
    docs = [toks(rng.integers(300, 601)) for _ in range(max(20, 2 * num_replicas))]
    doc_w = _zipf_weights(len(docs), zipf_s)
    n_total = requests_per_replica * num_replicas

    reqs: list[SimRequest] = []
    kinds = rng.choice(3, size=n_total, p=list(mix))
    while len(reqs) < n_total:
        kind = ("chat", "session", "rag")[kinds[len(reqs)]]
        rid = f"r{len(reqs)}"
        if kind == "chat":
            t = int(rng.choice(num_tenants, p=tenant_w))
            reqs.append(SimRequest(rid, 0.0, systems[t] + toks(rng.integers(50, 200)),
                                   toks(rng.integers(16, 64)), f"tenant-{t}", kind))
        elif kind == "rag":
            pick = rng.choice(len(docs), size=3, replace=False, p=doc_w)
            prompt = rag_system + [x for d in pick for x in docs[d]] + toks(rng.integers(30, 100))
            reqs.append(SimRequest(rid, 0.0, prompt, toks(rng.integers(16, 64)), None, kind))
        else:
            t = int(rng.choice(num_tenants, p=tenant_w))
            history = list(systems[t])
            for turn in range(int(rng.integers(2, 6))):
                prompt = history + toks(rng.integers(30, 150))
                out = toks(rng.integers(16, 64))
                reqs.append(SimRequest(f"{rid}.{turn}", 0.0, prompt, out, f"tenant-{t}", kind))
                history = prompt + out
    reqs = reqs[:n_total]
    mean_work_s = np.mean([cost.request_work_ms(len(r.prompt), int(ref_hit * len(r.prompt)), len(r.output))
                           for r in reqs]) / 1000
    rate = utilisation * num_replicas / mean_work_s  # requests per second
    # Poisson arrivals; a session's turns keep their order, spaced by a think time.
    arrivals = np.cumsum(rng.exponential(1 / rate, size=len(reqs)))
    session_last: dict[str, float] = {}
    for r, t in zip(reqs, arrivals):
        r.arrival = float(t)
        if r.kind == "session":
            sid = r.request_id.split(".")[0]
            if sid in session_last:
                r.arrival = max(r.arrival, session_last[sid] + float(rng.uniform(5, 20)))
            session_last[sid] = r.arrival
    reqs.sort(key=lambda r: r.arrival)
    return reqs
