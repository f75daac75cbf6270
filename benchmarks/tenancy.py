"""Issue 13 figures: what the tenancy modes leak and what they cost.

``python -m benchmarks.tenancy`` prints a markdown table of

* **attacker AUC in shared-public mode** (and, with ``--audit-modes shared-public,shared``, in
  shared mode for contrast): ``kvmosaic audit`` against a real ``kvmosaic serve --tenancy
  shared-public`` whose ``--public-prefix-file`` registers a system prompt; every probe is that
  public prompt followed by the secret (the private text) and a short random suffix, so the
  public head is cached for both arms and only the private part can tell them apart;
* **reuse kept by shared-public vs shared**: the same multi-tenant workload (every request: the
  registered public system prompt, the tenant's own document, a fresh question) through one
  engine in each mode; the ratio of prefix-cache hit tokens (target >= 0.9);
* **throughput cost of isolated vs shared** on a workload with no cross-tenant sharing (each
  tenant's prompts are its own): the arms alternate in one run (shared, isolated, shared, ...)
  on one engine with the cache reset before each, and the ratio of the median wall times is
  reported (target <= 2 %).

The engine-level parts go through the server's own salt code (:class:`TenantPolicy`,
``ProcessedPrompt.public_blocks``). CPU, float32 by default; the machine may be shared and noisy,
hence interleaving and ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

PUBLIC_TEXT = ("You are the support assistant of a hardware store. Answer briefly and politely. Opening hours are nine "
               "to six, Monday to Saturday; returns are accepted for thirty days with a receipt. Never share one "
               "customer's details with another customer. Prices include tax. Delivery in town costs ten euros and "
               "takes three days; keys are cut while you wait, except on Sundays.")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


# ---- audit against a real server ------------------------------------------------------------
def audit(mode: str, public_ids: list[int], lengths: list[int], probes: int, threads: int, seed: int) -> list:
    from kvmosaic.audit import Auditor
    from kvmosaic.server.launch import ServerProcess

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(PUBLIC_TEXT + "\n")
    args = ["--dtype", "float32", "--max-model-len", "1024", "--num-threads", str(threads),
            "--api-key", "key-a", "--api-key", "key-b", "--tenancy", mode]
    if mode == "shared-public":
        args += ["--public-prefix-file", f.name]
    with ServerProcess(*args).start() as server:
        auditor = Auditor(server.url, "key-a", "key-b", suffix=4, seed=seed, prefix=public_ids)
        return auditor.run(lengths, probes, order_pairs=0)


# ---- reuse and throughput, through one engine -------------------------------------------------
def _processed(engine, policy, public, ids: list[int], tenant: str):
    """The prompt as the server queues it: the tenant's salt and, shared-public, its public head."""
    from dataclasses import replace

    processed = engine.inputs.process(ids, policy.cache_salt(tenant, None))
    if policy.mode == "shared-public":
        processed = replace(processed, public_blocks=public.blocks(ids))
    return processed


def _run(engine, prompts: list[tuple[str, list[int]]], policy, public, max_tokens: int) -> tuple[int, float]:
    """All prompts queued at once; returns (prefix-cache hit tokens, wall seconds)."""
    from kvmosaic.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    for tenant, ids in prompts:
        engine.add_processed(_processed(engine, policy, public, ids, tenant), params)
    hits = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                hits += out.num_cached_tokens
    return hits, time.perf_counter() - t0


def reuse_workload(rng: random.Random, public_ids: list[int], tenants: int, per_tenant: int,
                   doc: int, question: int) -> list[tuple[str, list[int]]]:
    docs = {f"key-{t}": _ids(rng, doc) for t in range(tenants)}
    return [(t, public_ids + docs[t] + _ids(rng, question)) for _ in range(per_tenant) for t in docs]


def private_workload(rng: random.Random, tenants: int, per_tenant: int, prompt: int) -> list[tuple[str, list[int]]]:
    return [(f"key-{t}", _ids(rng, prompt)) for _ in range(per_tenant) for t in range(tenants)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenancy", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,64,256")
    p.add_argument("--probes", type=int, default=40, help="audit probes per arm and length")
    p.add_argument("--audit-modes", default="shared-public", help="comma-separated; '' skips the audit")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--per-tenant", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5, help="throughput: interleaved rounds per arm")
    p.add_argument("--max-tokens", type=int, default=16, help="throughput workload output tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads (engine and server)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from kvmosaic.engine.llm_engine import LLMEngine
    from kvmosaic.server.tenancy import TenantPolicy, build_public_prefixes

    engine = LLMEngine(dtype="float32", device="cpu", max_model_len=1024, num_threads=args.threads)
    public = build_public_prefixes(engine, [PUBLIC_TEXT], [])
    public_ids = engine.inputs.process(PUBLIC_TEXT, None).prompt_token_ids
    keys = frozenset(f"key-{t}" for t in range(args.tenants))
    policies = {m: TenantPolicy(api_keys=keys, mode=m, public=public) for m in ("shared", "shared-public", "isolated")}
    rows = []

    # reuse kept (deterministic: one run per mode)
    wl = reuse_workload(random.Random(args.seed), public_ids, args.tenants, args.per_tenant, 48, 16)
    hits = {m: _run(engine, wl, pol, public, 1)[0] for m, pol in policies.items()}
    total = sum(len(ids) for _, ids in wl)
    rows.append(("reuse kept, shared-public / shared (hit tokens)", f"{hits['shared-public'] / hits['shared']:.3f}",
                 ">= 0.9", f"{len(wl)} requests, {args.tenants} tenants, public prompt {len(public_ids)} tok "
                 f"+ tenant doc 48 + question 16; hit tokens shared {hits['shared']}, shared-public "
                 f"{hits['shared-public']}, isolated {hits['isolated']} of {total}"))

    # throughput cost (interleaved)
    wl = private_workload(random.Random(args.seed + 1), args.tenants, args.per_tenant, 96)
    _run(engine, wl, policies["shared"], public, args.max_tokens)  # warm-up
    times = {"shared": [], "isolated": []}
    for _ in range(args.rounds):
        for m in ("shared", "isolated"):
            times[m].append(_run(engine, wl, policies[m], public, args.max_tokens)[1])
    ratio = statistics.median(times["isolated"]) / statistics.median(times["shared"])
    per_pair = [i / s for i, s in zip(times["isolated"], times["shared"])]
    rows.append(("throughput cost, isolated vs shared (no cross-tenant sharing)", f"{(ratio - 1) * 100:+.1f} %",
                 "<= 2 %", f"{len(wl)} requests x (96 prompt + {args.max_tokens} output tok), {args.rounds} interleaved "
                 f"rounds; median wall s shared {statistics.median(times['shared']):.2f}, isolated "
                 f"{statistics.median(times['isolated']):.2f}; per-round ratios "
                 + ", ".join(f"{r:.3f}" for r in per_pair)))

    # attacker AUC against real servers
    lengths = [int(x) for x in args.lengths.split(",") if x]
    for mode in [m for m in args.audit_modes.split(",") if m]:
        for r in audit(mode, public_ids, lengths, args.probes, args.threads, args.seed):
            target = "<= 0.60" if mode != "shared" else "reported (the leak)"
            rows.append((f"attacker AUC, {mode}, {r.length}-token secret after the public prompt", f"{r.auc:.2f}",
                         target, f"{r.probes} probes/arm; KS p {r.ks_p:.2g}; cached_tokens true/wrong "
                         f"{r.cached_true:.0f}/{r.cached_wrong:.0f}; median TTFT true/wrong "
                         f"{statistics.median(r.ttft_true_ms):.0f}/{statistics.median(r.ttft_wrong_ms):.0f} ms"))

    print("| measure | value | target | details |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
