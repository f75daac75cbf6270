"""What a better choice of recomputed tokens could give automatic reuse (issue 24).

Issue 24 asks of reordered RAG documents, at once, a TTFT 2.5x lower than prefix caching alone and a
mean KL to full prefill of at most 0.02. TTFT follows *how many* prompt rows a blend recomputes; KL
follows *which*. This benchmark takes the two apart on ``benchmarks.auto_reuse``'s RAG workloads: for
each setting (the moved joins' head tokens, and a budget: the engine's ``blend_ratio`` times a factor)
it measures, per request,

* the engine's TTFT in auto mode against prefix caching alone, through ``LLM.generate`` (as
  ``benchmarks.auto_reuse`` does, the chunk index fed the same way), and the prompt rows recomputed;
* the mean KL to full prefill over 16 teacher-forced tokens (``auto_reuse``'s method) of two blends
  of the same placed chunks that recompute the same number of reused tokens: the engine's choice (the
  check layer's deviation weighted by the answer's attention, ``blend/select.py``) and an **oracle's**.

The oracle ranks the reused tokens by what only a full prefill of the prompt tells: each token's
true deviation, the relative L2 distance of its placed K, V from the full prefill's, averaged over
every layer (the check layer's deviation is the engine's estimate of it at one early layer). It is a
reference for choices that rank tokens by how wrong their KV is, not a proof that no choice does
better; the engine cannot compute it without the full prefill it is there to avoid.

Run: ``python -m benchmarks.auto_reuse_oracle`` (``--requests``, ``--heads``, ``--budgets``,
``--workloads``, ``--dtype``). Results: BENCHMARKS.md, issue 24.
"""

from __future__ import annotations

import argparse
import gc
import random
from dataclasses import replace

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.blend.blender import picker
from kvmosaic.blend.forward import blend_forward
from kvmosaic.engine.arg_utils import EngineArgs

from .auto_reuse import FORCED, Harness, Req, Stats, earlier_traffic, rag_requests
from .blend_quality import kl

NO_BOUND = 1.0  # the guard's bound in these runs: far above any estimate, so no repair changes the budget


def true_deviation(exact: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    """Per token, the relative L2 deviation of ``placed`` K, V from ``exact`` (``[L, 2, T, kv_heads,
    head_dim]``, as ``Blender.read`` gives them) at each layer, averaged over the layers: ``[T]``."""
    a = exact.float().permute(0, 2, 1, 3, 4).flatten(2)  # [L, T, 2 * kv_heads * head_dim]
    b = placed.float().permute(0, 2, 1, 3, 4).flatten(2)
    return ((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)).mean(0)


def oracle_picker(engine_pick, deviation: torch.Tensor):
    """A picker (``blend/forward.py``) choosing as many reused tokens as ``engine_pick`` does, those
    with the highest ``deviation`` (one per reused token, in position order, as the scores come)."""
    def pick(scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        count = engine_pick(scores, attention).numel()
        return torch.topk(deviation, count).indices.sort().values
    return pick


def forced_kl(h: Harness, r: Req, answer: list[int]) -> tuple[float, float, int]:
    """(KL mean of the engine's choice, of the oracle's, prompt rows recomputed) for one request, on
    the slots the engine would give it behind its prefix hit."""
    e, blender, auto = h.engine, h.engine.segment_reuse.blender, h.engine.segment_reuse.auto
    opts = replace(h.opts, max_drift=None)
    with h.forced_slots(r.prompt, r.warm, answer) as (p_ids, ids, slots, start, positions):
        pos_t, ids_t = torch.tensor(positions), torch.tensor(ids)
        full = blend_forward(e.model, e.kv, ids_t, slots, start, torch.zeros(len(ids), dtype=torch.bool), pos_t, None)
        ref = torch.log_softmax(full.logits.float(), -1)
        exact = blender.read(slots)
        spans = auto.plan(p_ids, start, None, None) or ()
        kls, rows = [], 0
        for oracle in (False, True):
            reused = blender.place(ids, spans, slots, start, opts.head, positions).reused
            engine_pick = picker(opts, [])
            pick = engine_pick
            if oracle:
                at = reused.nonzero().squeeze(1)
                pick = oracle_picker(engine_pick, true_deviation(exact[:, :, at], blender.read(slots[at])))
            out = blend_forward(e.model, e.kv, ids_t, slots, start, reused, pos_t, pick, opts.check_layer)
            kls.append(float(kl(ref, torch.log_softmax(out.logits.float(), -1)).mean()))
            rows = int(out.recomputed[start : len(p_ids)].sum())
    return kls[0], kls[1], rows


def study(dtype: str, chat: bool, head: int, budget: float, requests: int, seed: int) -> Stats:
    """One setting on one workload, in a fresh engine fed as ``benchmarks.auto_reuse`` feeds it."""
    ratio = EngineArgs.blend_ratio * budget
    h = Harness(dtype, NO_BOUND, blend_head_tokens=head, blend_ratio=min(1.0, ratio))
    rng = random.Random(seed)
    earlier_traffic(h, rng, chat)
    st = Stats()
    for r in rag_requests(requests, rng, h.tok, chat):
        full = h.run(False, r.prompt, None, FORCED)
        kl_engine, kl_oracle, rows = forced_kl(h, r, full.token_ids[:FORCED])
        prefix = h.run(False, r.prompt, r.warm, FORCED)
        auto = h.run(True, r.prompt, r.warm, FORCED)  # feeds the index, as every prefill does
        st.add(kl_engine=kl_engine, kl_oracle=kl_oracle, rows=rows, prompt=len(auto.prompt_token_ids),
               ttft_prefix=prefix.metrics["ttft"], ttft_auto=auto.metrics["ttft"])
    del h
    gc.collect()
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=24, help="measured requests per workload and setting")
    ap.add_argument("--heads", default="12,0", help="comma-separated blend_head_tokens settings")
    ap.add_argument("--budgets", default="0.5,1,1.5",
                    help="comma-separated factors of the engine's blend_ratio (the reused tokens recomputed)")
    ap.add_argument("--workloads", default="rag-text,rag-chat", help="rag-text and / or rag-chat")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(describe(), flush=True)
    lines = ["| workload | head tokens | budget (x ratio) | prompt tokens | rows recomputed | TTFT prefix / auto (p50) "
             "| auto vs prefix | KL mean: engine's choice | oracle's choice |", "|" + "---|" * 9]
    for name in args.workloads.split(","):
        for head in (int(x) for x in args.heads.split(",")):
            for budget in (float(x) for x in args.budgets.split(",")):
                st = study(args.dtype, name == "rag-chat", head, budget, args.requests, args.seed)
                line = (f"| {name} | {head} | {budget:g} | {st.mean('prompt'):.0f} | {st.mean('rows'):.0f} | "
                        f"{st.median('ttft_prefix'):.3f} / {st.median('ttft_auto'):.3f} | "
                        f"{st.median('ttft_prefix') / st.median('ttft_auto'):.2f}x | {st.mean('kl_engine'):.4f} | "
                        f"{st.mean('kl_oracle'):.4f} |")
                print(line, flush=True)
                lines.append(line)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
