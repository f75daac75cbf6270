"""Reuse that finds itself (issue 24): ``segment_reuse="auto"`` on workloads nobody marked.

Workloads (plain prompts, no ``segments`` field, no separator; built in ``auto_reuse_workloads.py``):

* ``rag-text``: a system line, 5 of 20 documents (~75 tokens each) in random order (blank lines
  between them) and a question whose answer is a fact in one of them, as a plain completion prompt
  (no chat template); ``rag-chat``: the same in chat form (system and user messages through the
  model's template); ``rag-long-text`` /
  ``rag-long-chat`` (not in the default set): the same with the five whole documents (~280 tokens
  each, the 20 short ones are their quarters), each seen once before in another order;
* ``sys-timestamp``: a ~2,000-token system prompt whose first line is a timestamp that changes
  on every request, then a short question;
* ``chat-edit``: multi-turn chats (3 user turns, 2 answers) resent with the name in the first
  user message changed (the original was seen before; prefix caching stops at the edit);
* ``no-reuse``: distinct random prompts, batched, to measure what ``auto`` costs when nothing
  is found (throughput with auto on / off, alternated).

Per request and mode (full prefill; prefix caching alone; auto), as ``blend_quality`` measures:
TTFT through the engine with the caches as the mode would find them (the system prompt, or the
first request of sys-timestamp, prefix-cached; auto's chunk index fed by every earlier request
and a warm-up pass), KL to full prefill at the first answer token and mean teacher-forced KL over
16 tokens (same slots, the engine's own blend + guard code), greedy agreement, answer accuracy,
and auto's reused tokens, drift estimate and guard fallbacks.

Run: ``python -m benchmarks.auto_reuse`` (``--requests``, ``--ratio``, ``--max-drift``, ``--seed``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.bench.text import paragraph
from kvmosaic.blend.guard import guard
from kvmosaic.cache.manager import PlainRequest
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams

from .auto_reuse_workloads import DOCS, POOL, Req, edit_requests, rag_long_requests, rag_prompt, rag_requests, sys_requests
from .blend_quality import kl

FORCED = 16


def earlier_traffic(h: Harness, rng: random.Random, chat: bool, seen: int = 1) -> None:
    """Before the measured RAG requests: each of the 20 documents shown ``seen`` times, in prompts of
    five in a new random order each round (so in other company each time), in auto mode."""
    for _ in range(seen):
        order = list(range(len(POOL)))
        rng.shuffle(order)
        for k in range(0, len(POOL), 5):
            h.run(True, rag_prompt([POOL[j] for j in order[k : k + 5]], "Hello?", h.tok, chat)[0], None, 1)


class Harness:
    def __init__(self, dtype: str, max_drift: float, device: str = "cpu", **blend) -> None:
        """``blend``: the engine's ``blend_*`` options (its defaults where not given)."""
        self.llm = LLM(dtype=dtype, device=device, num_kv_blocks=2048, segment_cache_memory=2 << 30,
                       segment_reuse="auto", auto_reuse_max_drift=max_drift, **blend)
        self.engine, self.tok = self.llm.engine, self.llm.tokenizer
        self.opts = self.engine.segment_reuse.options()  # the engine's own, as auto uses them

    def audited(self, since: tuple[int, float, float] | None = None):
        """The shadow audit's (count, KL sum, seconds) now; with ``since``, the (KL, seconds) of the one audit
        run after it (None if none ran)."""
        st = self.engine.segment_reuse.audit.stats
        if since is None:
            return st.audits, st.kl_sum, st.seconds
        return (st.kl_sum - since[1], st.seconds - since[2]) if st.audits == since[0] + 1 else None

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def run(self, auto: bool, prompt: str, warm: str | None, max_tokens: int):
        """One request through the engine, the prefix cache holding ``warm`` only."""
        e = self.engine
        e.reset_prefix_cache()
        e.config.segment_reuse = "off"  # the warm part computed in full, as when it was first seen
        if warm:
            self.llm.generate({"prompt_token_ids": self.ids(warm)}, SamplingParams(max_tokens=1))
        e.config.segment_reuse = "auto" if auto else "off"
        return self.llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]

    @contextlib.contextmanager
    def forced_slots(self, prompt: str, warm: str, answer: list[int]):
        """Slots for ``prompt`` and ``answer`` but its last token, allocated as the engine would behind the
        prefix hit of ``warm`` alone: yields (prompt ids, ids, slots, start, the logits positions: the
        prompt's last and the answer's), freed on exit."""
        e = self.engine
        e.reset_prefix_cache()
        e.config.segment_reuse = "off"
        self.llm.generate({"prompt_token_ids": self.ids(warm)}, SamplingParams(max_tokens=1))
        p_ids = self.ids(prompt)
        ids = p_ids + answer[:-1]
        fake = PlainRequest(f"forced-{time.monotonic_ns()}", ids)
        match = e.cache.match_prefix(fake)
        table = e.cache.allocate_slots(fake, len(ids), match)
        try:
            yield (p_ids, ids, e.kv.slots(table, len(ids)), min(match.num_tokens, len(p_ids) - 1),
                   list(range(len(p_ids) - 1, len(ids))))
        finally:
            e.cache.free(fake)

    def forced(self, auto: bool, prompt: str, warm: str, answer: list[int]):
        """Log-probabilities at the answer's positions (answer forced), as the engine would
        compute them: the prefix hit first, then (auto) the chunks found, blended and guarded."""
        e, sr = self.engine, self.engine.segment_reuse
        with self.forced_slots(prompt, warm, answer) as (p_ids, ids, slots, start, positions):
            auto = auto and not sr.breaker.off((None, None))  # as the engine: no reuse while its breaker is off
            spans = (sr.auto.plan(p_ids, start, None, None) or ()) if auto else ()
            res = sr.blender.prefill(ids, spans, slots, start, self.opts, logits_positions=positions)
            verdict = guard(e.model, e.kv, ids, slots, res, e.config.auto_reuse_max_drift, positions)
        return torch.log_softmax(verdict.logits.float(), -1), verdict, res


@dataclass
class Stats:
    rows: dict = field(default_factory=dict)

    def add(self, **kv) -> None:
        for k, v in kv.items():
            self.rows.setdefault(k, []).append(v)

    def mean(self, k: str) -> float:
        return statistics.mean(self.rows[k]) if self.rows.get(k) else float("nan")

    def median(self, k: str) -> float:
        return statistics.median(self.rows[k]) if self.rows.get(k) else float("nan")


def measure(h: Harness, reqs: list[Req], max_tokens: int, label: str) -> Stats:
    st = Stats()
    for i, r in enumerate(reqs):
        full = h.run(False, r.prompt, None, max_tokens)
        ref_lp, _, _ = h.forced(False, r.prompt, r.warm, full.token_ids[:FORCED])
        lp, verdict, res = h.forced(True, r.prompt, r.warm, full.token_ids[:FORCED])
        k = kl(ref_lp, lp)
        prefix = h.run(False, r.prompt, r.warm, max_tokens)
        audited = h.audited()
        auto = h.run(True, r.prompt, r.warm, max_tokens)
        audit = h.audited(since=audited)
        st.add(tripped=h.engine.segment_reuse.breaker.off((None, None)))
        audited = audit[0] if audit is not None else None
        if audit is not None:  # the shadow audit's measure of the same answer, beside the harness's own
            n = h.engine.config.auto_reuse_audit_tokens  # the audit forces auto's tokens, the harness full's
            same = auto.token_ids[:n - 1] == full.token_ids[:n - 1]
            st.add(audit_kl=audited, audit_s=audit[1], audit_same=same,
                   audit_gap=abs(audited - float(k[:n].mean())) if same else float("nan"))
        a = auto.auto_reuse or {"tokens": 0, "drift": None, "fallback": False, "repaired": 0}
        doc_tokens = sum(len(h.ids(d)) for d in r.docs)
        st.add(ttft_full=full.metrics["ttft"], ttft_prefix=prefix.metrics["ttft"], ttft_auto=auto.metrics["ttft"],
               kl_first=float(k[0]), kl_mean=float(k.mean()),
               agree_tokens=sum(x == y for x, y in zip(auto.token_ids, full.token_ids)) / len(full.token_ids),
               agree_all=float(auto.token_ids == full.token_ids),
               reused=a["tokens"], prompt=len(auto.prompt_token_ids), cached=auto.num_cached_tokens,
               doc_share=a["tokens"] / doc_tokens if doc_tokens else float("nan"),
               fallback=float(a["fallback"]), drift=a["drift"] if a["drift"] is not None else 0.0,
               repaired=a["repaired"],
               forced_drift=res.drift, forced_drift_attn=res.drift_attn, forced_fallback=float(verdict.fell_back),
               bad_answered=float(not verdict.fell_back and verdict.num_reused_tokens > 0
                                  and float(k.mean()) > h.engine.config.auto_reuse_max_drift),
               acc_full=float(r.answer.lower() in full.text.lower()) if r.answer else float("nan"),
               acc_auto=float(r.answer.lower() in auto.text.lower()) if r.answer else float("nan"))
        print(f"{label} {i + 1}/{len(reqs)}: prompt {len(auto.prompt_token_ids)}, prefix hit {prefix.num_cached_tokens}, "
              f"auto reused {a['tokens']} (drift {a['drift']}, fallback {a['fallback']}, repaired {a['repaired']}), "
              f"KL mean {float(k.mean()):.4f} "
              f"(forced: drift {res.drift:.4f}, attention-weighted {res.drift_attn:.5f}), "
              f"TTFT full/prefix/auto {full.metrics['ttft']:.2f}/{prefix.metrics['ttft']:.2f}/"
              f"{auto.metrics['ttft']:.2f} s" + (f", audit KL {audited:.4f}" if audited is not None else ""), flush=True)
    return st


def no_reuse(h: Harness, rounds: int, batch: int, rng: random.Random) -> tuple[float, float]:
    """Throughput (prompt + generated tokens / s) with auto off and on, alternated; medians."""
    tps = {False: [], True: []}
    for _ in range(rounds):
        for auto in (False, True):
            prompts = [paragraph(rng, 220) for _ in range(batch)]
            h.engine.reset_prefix_cache()
            h.engine.config.segment_reuse = "auto" if auto else "off"
            t = time.perf_counter()
            outs = h.llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            dt = time.perf_counter() - t
            assert all((o.auto_reuse or {"tokens": 0})["tokens"] == 0 for o in outs)
            tps[auto].append(sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) / dt)
    return statistics.median(tps[False]), statistics.median(tps[True])


def table(results: dict[str, Stats], thr: tuple[float, float]) -> str:
    lines = ["| workload | requests | prompt tokens (mean) | prefix hit (mean) | auto reused (mean) | doc tokens reused "
             "| TTFT full / prefix / auto, s (p50) | auto vs prefix | KL first / mean | greedy agreement (tokens; "
             "requests all equal) | accuracy full / auto (answers auto lost, gained) | fallbacks | repairs (requests; tokens, mean) "
             "| drift est. (mean) | answered from reuse with KL mean > the bound |", "|" + "---|" * 15]
    for name, s in results.items():
        n = len(s.rows["kl_mean"])
        lines.append(
            f"| {name} | {n} | {s.mean('prompt'):.0f} | {s.mean('cached'):.0f} | {s.mean('reused'):.0f} | "
            f"{s.mean('doc_share'):.0%} | {s.median('ttft_full'):.2f} / {s.median('ttft_prefix'):.2f} / "
            f"{s.median('ttft_auto'):.2f} | {s.median('ttft_prefix') / s.median('ttft_auto'):.2f}x | "
            f"{s.mean('kl_first'):.4f} / {s.mean('kl_mean'):.4f} | {s.mean('agree_tokens'):.2f}; "
            f"{s.mean('agree_all'):.0%} | {s.mean('acc_full'):.2f} / {s.mean('acc_auto'):.2f}{answers(s)} | "
            f"{sum(s.rows['fallback']):.0f} | {sum(r > 0 for r in s.rows['repaired'])}; {s.mean('repaired'):.1f} | "
            f"{s.mean('drift'):.4f} | {sum(s.rows['bad_answered']):.0f} |")
    off, on = thr
    lines.append(f"\nno-reuse throughput, auto off / on: {off:.0f} / {on:.0f} tok/s (ratio {on / off:.3f})")
    return "\n".join(lines)


def answers(s: Stats) -> str:
    """The paired count behind an accuracy difference: the answers full prefill got and auto missed, and the
    reverse. Their sum sets the resolution: the difference's standard error is about sqrt(lost + gained) / n."""
    pairs = [(f, a) for f, a in zip(s.rows.get("acc_full", []), s.rows.get("acc_auto", [])) if f == f]  # not NaN
    if not pairs:
        return ""
    return f" ({sum(f > a for f, a in pairs)}, {sum(a > f for f, a in pairs)})"


def audit_line(name: str, st: Stats, bound: float, tokens: int) -> str:
    """What the engine's shadow audit measured over a workload, against the harness's own KL over the same
    tokens (where the reused answer's tokens equal full prefill's, which the harness forces)."""
    kls = st.rows["audit_kl"]
    gaps = [g for g in st.rows["audit_gap"] if g == g]
    over = "KL first" if tokens == 1 else f"mean KL over {tokens} tokens"
    return (f"shadow audit, {name}: {len(kls)} answers audited, {sum(k > bound for k in kls)} over the bound "
            f"{bound} ({over}), mean {statistics.mean(kls):.4f}, {statistics.mean(st.rows['audit_s']) * 1e3:.0f} ms "
            f"an audit; against the harness's, on the {len(gaps)} answers whose audited tokens equal full "
            f"prefill's: largest difference {max(gaps, default=float('nan')):.2g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="measured requests per workload")
    ap.add_argument("--ratio", type=float, default=None, help="blend_ratio (default: the engine's)")
    ap.add_argument("--head", type=int, default=None, help="blend_head_tokens (default: the engine's)")
    ap.add_argument("--selection", default=None, help="blend_selection (default: the engine's)")
    ap.add_argument("--check-layer", type=int, default=None, help="blend_check_layer (default: the engine's)")
    ap.add_argument("--contexts", type=int, default=None,
                    help="auto_reuse_contexts: contexts a chunk is computed in before reuse (default: the engine's)")
    ap.add_argument("--seen", type=int, default=1,
                    help="RAG: earlier traffic shows each document this many times, each in other company")
    ap.add_argument("--max-drift", type=float, default=0.03, help="auto_reuse_max_drift (the guard's bound)")
    ap.add_argument("--audit-rate", type=float, default=0.0,
                    help="auto_reuse_audit_rate: answers from reused KV measured against a full prefill by the "
                         "engine's shadow audit (after the answer; not in TTFT), compared with the harness's KL first")
    ap.add_argument("--audit-tokens", type=int, default=None,
                    help="auto_reuse_audit_tokens: answer tokens each audit covers (default: the engine's, 1)")
    ap.add_argument("--audit-trip", type=float, default=None,
                    help="auto_reuse_audit_trip: the breaker's share (with --audit-rate); run one workload at a time, "
                         "their requests share a namespace")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the engine's device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="no-reuse: alternated rounds")
    ap.add_argument("--no-reuse-only", action="store_true", help="only the no-reuse throughput")
    ap.add_argument("--workloads", default="rag-text,rag-chat,sys-timestamp,chat-edit",
                    help="comma-separated: rag-text, rag-chat, rag-long-text, rag-long-chat, sys-timestamp, "
                         "chat-edit")
    args = ap.parse_args()
    print(describe(), flush=True)
    rng = random.Random(args.seed)
    blend = {k: v for k, v in (("blend_ratio", args.ratio), ("blend_head_tokens", args.head),
                               ("blend_selection", args.selection), ("blend_check_layer", args.check_layer),
                               ("auto_reuse_contexts", args.contexts), ("auto_reuse_audit_rate", args.audit_rate or None),
                               ("auto_reuse_audit_tokens", args.audit_tokens), ("auto_reuse_audit_trip", args.audit_trip))
             if v is not None}
    h = Harness(args.dtype, args.max_drift, args.device, **blend)
    print(f"blend options: {h.opts}", flush=True)
    if args.no_reuse_only:
        h.engine.segment_reuse.auto  # noqa: B018 - build the chunk rule before timing
        off, on = no_reuse(h, args.rounds, 8, rng)
        print(f"no-reuse throughput, auto off / on: {off:.0f} / {on:.0f} tok/s (ratio {on / off:.3f})")
        return
    results = {}
    todo = args.workloads.split(",")
    for name, chat in (("rag-text", False), ("rag-chat", True)):
        if name not in todo:
            continue
        earlier_traffic(h, rng, chat, args.seen)
        results[name] = measure(h, rag_requests(args.requests, rng, h.tok, chat), FORCED, name)
    for name, chat in (("rag-long-text", False), ("rag-long-chat", True)):
        if name not in todo:
            continue
        h.run(True, rag_prompt(rng.sample(DOCS, len(DOCS)), "Hello?", h.tok, chat)[0], None, 1)  # each seen once
        results[name] = measure(h, rag_long_requests(args.requests, rng, h.tok, chat), FORCED, name)
    if "sys-timestamp" in todo:
        first, reqs = sys_requests(args.requests, rng)
        h.run(True, first, None, 1)
        results["sys-timestamp"] = measure(h, reqs, 32, "sys-timestamp")
    if "chat-edit" in todo:
        originals, reqs = edit_requests(args.requests, rng, h.tok)
        for o in originals:  # each conversation was seen before its edit
            h.run(True, o, None, 1)
        results["chat-edit"] = measure(h, reqs, 32, "chat-edit")
    h.engine.config.auto_reuse_audit_rate = 0.0  # the no-reuse rounds measure the engine, not the audit
    thr = no_reuse(h, args.rounds, 8, rng)
    print(table(results, thr))
    for name, st in results.items():
        if st.rows.get("audit_kl"):
            print(audit_line(name, st, h.engine.config.auto_reuse_max_drift, h.engine.config.auto_reuse_audit_tokens))
        if args.audit_trip is not None:
            first = next((i + 1 for i, off in enumerate(st.rows["tripped"]) if off), None)
            print(f"breaker, {name}: automatic reuse off after measured request {first} "
                  f"({h.engine.segment_reuse.breaker.trips} trips in the run)")
    # Pooled over workloads the estimate mostly ranks the workloads (a repair drifts less than a moved
    # document); within one it must rank the requests, which is what a per-request guard needs.
    groups = {"all workloads": list(results.values()), **{name: [s] for name, s in results.items()}}
    for label, stats in groups.items():
        drift = [d for s in stats for d in s.rows["forced_drift"]]
        attn = [a for s in stats for a in s.rows["forced_drift_attn"]]
        kl_mean = [k for s in stats for k in s.rows["kl_mean"]]
        print(f"drift estimate against KL mean (Spearman), {label}: mean deviation {spearman(drift, kl_mean):.2f}, "
              f"attention-weighted {spearman(attn, kl_mean):.2f}")


def spearman(x: list[float], y: list[float]) -> float:
    rx = torch.tensor(x).argsort().argsort().float()
    ry = torch.tensor(y).argsort().argsort().float()
    return float(torch.corrcoef(torch.stack((rx, ry)))[0, 1])


if __name__ == "__main__":
    main()
