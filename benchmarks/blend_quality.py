"""Quality and TTFT of segment reuse on the rag-reorder workload (issue 6).

Every request is one system prompt, the same five documents (~300 tokens each) in a
different order, and a question whose answer is a fact stated in one document. Each mode is
compared with full prefill of the same prompt:

* TTFT: median over requests, through the engine (``LLM.generate``), with the system prompt
  prefix-cached and every document already in the segment store, as a first request with the
  documents in order 1..5 left them (full prefill: cold);
* KL at the first answer token and mean teacher-forced KL over 16 tokens: the mode's logits
  on full prefill's greedy answer, against full prefill's, computed with the same blend code
  (``Blender.prefill``) on the same request;
* greedy agreement: the fraction of the 16 free-running greedy tokens equal to full prefill's;
* accuracy: whether the answer string appears in the 16 generated tokens.

Run: ``python -m benchmarks.blend_quality`` (``--requests``, ``--check-layer``, ``--seed``, ``--kinds``,
``--out``). Prints a markdown
table and writes a Pareto plot of KL against TTFT into ``docs/blend/``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvmosaic.blend.blender import BlendOptions
from kvmosaic.blend.prompt import parse_segment_prompt
from kvmosaic.cache.manager import PlainRequest
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams

HEAD = "<|im_start|>system\nYou answer questions using only the documents the user gives you.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "Document 1. The town of Brellin sits at the mouth of the Oska river, where the water turns green in spring. "
    "Brellin was founded in the year 1612 by a group of salt traders who needed a safe harbour for the winter. "
    "Today about nine thousand people live there, and most of them work in fishing, boat repair or tourism. "
    "The tallest building in Brellin is the lighthouse, which is painted red and white and stands 41 meters high. "
    "Every August the town holds a lantern festival on the beach, and visitors walk along the sand with paper lights. "
    "The mayor of Brellin is a retired ship captain named Ida Varga, who was elected for the third time last year. "
    "Local bakers are proud of a sweet bread filled with plums and walnuts, which they sell only on Sundays. "
    "The harbour has two piers: the northern pier for fishing boats and the southern pier for ferries to the islands. "
    "A small museum near the market shows old maps, ropes, anchors and the logbook of the first salt ship. "
    "In winter the harbour sometimes freezes at its edges, and the children of Brellin skate between the moored boats. "
    "A narrow railway connects the town with the capital, and the journey takes a little more than four hours. "
    "Many painters have lived in Brellin, because the light over the river mouth changes color many times a day.",
    "Document 2. The Kestrel 7 is a small electric delivery robot built by the company Tamsin Works. "
    "It has six wheels, a top speed of 14 kilometers per hour and a cargo box that holds up to 20 kilograms. "
    "Its battery lasts for about nine hours of driving and charges fully in ninety minutes at a station. "
    "The robot finds its way with four cameras and a laser scanner mounted on a short mast on its roof. "
    "When it reaches a customer, it sends a text message with a four digit code that opens the cargo box. "
    "The first Kestrel robots were tested on the streets of the city of Halvor during a cold and snowy winter. "
    "Engineers painted the robots bright orange so that drivers and cyclists would notice them from far away. "
    "Tamsin Works was started by two sisters, Nora and Elsa Lind, in a garage behind their parents' house. "
    "The company now has about three hundred employees and sells its robots to shops, hospitals and universities. "
    "A newer model with a heated cargo box for warm meals is being tested by restaurants this year. "
    "Customers can follow the robot on a map in their phone and see exactly when it will arrive at the door. "
    "If a robot gets stuck, a remote operator in the company office can take control and drive it by hand. "
    "Each robot is washed and checked by a mechanic once a week, and its tires are replaced every spring.",
    "Document 3. The vault beneath the old library of Castell is opened with the code 4821, known only to the archivists. "
    "Inside the vault the archivists keep about two thousand handwritten books, many of them older than the library itself. "
    "The room is kept at a temperature of 16 degrees and the air is dried by a machine that hums day and night. "
    "Visitors may not enter the vault, but once a year, in October, a few books are carried upstairs for an exhibition. "
    "The oldest book in the collection is a herbal guide with drawings of more than four hundred plants. "
    "The head archivist is Tomas Reed, who has worked in the library for twenty-six years and knows every shelf by heart. "
    "Reed says the hardest part of his job is repairing the leather covers, which crack when the air is too dry. "
    "The library itself was built from grey stone and has a copper roof that turned green a long time ago. "
    "Students from the nearby university come to the reading room every day to study old letters and maps. "
    "The reading room has long oak tables, green lamps and tall windows that face the main square of Castell. "
    "Photography is allowed in the reading room, but only without a flash, to protect the ink on old pages. "
    "A volunteer group meets every Thursday evening to copy fragile letters into a digital catalogue. "
    "The catalogue already lists more than nine hundred letters, sorted by writer, year and town.",
    "Document 4. The Amber Valley cheese is made by a cooperative of eleven farms in the hills south of Lorn. "
    "The cheese is round, weighs about eight kilograms and ripens for at least fourteen months in a cool cellar. "
    "It is made only from the milk of brown mountain cows, which graze on high meadows from May until September. "
    "The rind is washed with salt water every week, which gives the cheese its orange color and its strong smell. "
    "The cooperative was founded in 1954 by farmers who wanted to sell their cheese together instead of alone. "
    "Each wheel carries a stamp with a small picture of a fox, the symbol that the cooperative chose at its founding. "
    "Chefs like to melt the cheese over potatoes or to serve it in thin slices with pears and honey. "
    "The cooperative sells about twelve thousand wheels every year, and most of them are exported to other countries. "
    "Tourists can visit the cellars on guided tours that run every Saturday morning during the summer. "
    "At the end of each tour, visitors taste three cheeses of different ages with bread and apple juice. "
    "The farms still make the cheese by hand in copper kettles, heated by wood fires in the early morning. "
    "In a good year the cows give more milk in June than in any other month, so June cheese is prized. "
    "The cellars are dug into the side of a hill, where the air stays cool and damp through the whole year.",
    "Document 5. Captain Mirela Dunn led the polar ship Northwind on its famous voyage across the frozen sea. "
    "The Northwind left port on the first of March with a crew of thirty-two sailors and four scientists. "
    "The ship was trapped in the ice for 63 days before a storm broke the ice and set it free again. "
    "During those days the scientists measured the thickness of the ice and the temperature of the water below it. "
    "The crew kept warm by burning coal and by playing music on a violin that the cook had brought on board. "
    "The ship's dog, a large grey husky named Pepper, became famous after the voyage when a book was written about her. "
    "When the Northwind finally returned home, thousands of people waited on the docks to welcome the sailors. "
    "Captain Dunn later wrote that the silence of the ice was the strangest thing she had ever experienced. "
    "The Northwind is now a museum ship, and visitors can see the captain's cabin and the small kitchen. "
    "The scientists brought back boxes of notes, water samples and drawings of seals and seabirds. "
    "Their measurements helped later sailors to plan safer routes through the ice in early spring. "
    "A statue of the captain and her dog now stands at the end of the harbour where the ship departed. "
    "Schoolchildren visit the statue every spring and leave small paper boats with messages at its feet.",
]
QUESTIONS = [
    ("What code opens the vault beneath the library of Castell?", "4821"),
    ("How many days was the Northwind trapped in the ice?", "63"),
    ("How tall is the lighthouse in Brellin, in meters?", "41"),
    ("What is the top speed of the Kestrel 7 robot in kilometers per hour?", "14"),
    ("Who is the mayor of Brellin?", "Ida Varga"),
    ("What was the name of the ship's dog on the Northwind?", "Pepper"),
    ("In what year was the Amber Valley cheese cooperative founded?", "1954"),
    ("Who is the head archivist of the library of Castell?", "Tomas Reed"),
    ("How many farms make the Amber Valley cheese?", "eleven"),
    ("Which company built the Kestrel 7 robot?", "Tamsin Works"),
]
ANSWER_TOKENS = 16
RATIOS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50, 1.0)
RANDOM_RATIOS = (0.05, 0.15, 0.30)
THRESHOLDS = (0.1, 0.05, 0.03)  # on the relative deviation score


@dataclass
class Config:
    name: str
    kind: str  # "full" | "prefix" | "shift" | "blend" | "attention" | "random" | "threshold"
    ratio: float | None = None
    threshold: float | None = None
    head: int = 0  # blend_head_tokens

    def options(self) -> BlendOptions | None:
        if self.kind in ("full", "prefix"):
            return None
        if self.kind == "shift":
            return BlendOptions("shift", head=self.head)
        sel = self.kind if self.kind in ("random", "attention") else "deviation"
        return BlendOptions("blend", self.ratio or 0.0, self.threshold, selection=sel, head=self.head)


@dataclass
class Row:
    name: str
    kind: str
    ttft_ms: float
    speedup: float
    kl_first: float
    kl_mean: float
    agreement: float
    accuracy: float
    reused_frac: float


def configs() -> list[Config]:
    out = [Config("full prefill", "full"), Config("prefix cache only", "prefix"), Config("shift", "shift")]
    out += [Config(f"blend r={r:.0%}", "blend", ratio=r) for r in RATIOS]
    out += [Config(f"attention r={r:.0%}", "attention", ratio=r) for r in RANDOM_RATIOS]
    out += [Config(f"random r={r:.0%}", "random", ratio=r) for r in RANDOM_RATIOS]
    out += [Config(f"blend dev>{t}", "threshold", threshold=t) for t in THRESHOLDS]
    return out


def requests(n: int, seed: int = 0) -> list[tuple[dict, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        docs = DOCS[:]
        rng.shuffle(docs)
        tail = f"Question: {question}<|im_end|>\n<|im_start|>assistant\n"
        out.append(({"prompt": HEAD, "segments": docs, "suffix": tail}, answer))
    return out


class Harness:
    """One float32 engine. Its segment store holds every document as a first request (HEAD,
    documents 1..5 in order) computed them; each measured request shuffles them."""

    def __init__(self, check_layer: int = 2) -> None:
        self.check_layer = check_layer
        self.llm = LLM(dtype="float32", num_kv_blocks=512, segment_cache_memory=512 << 20,
                       blend_check_layer=check_layer)
        self.engine = self.llm.engine
        self.greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
        self.set_mode(Config("warm", "blend", ratio=0.0))
        self.llm.generate({"prompt": HEAD, "segments": DOCS, "suffix": "Hello."}, SamplingParams(max_tokens=1))

    def set_mode(self, cfg: Config) -> None:
        c, opts = self.engine.config, cfg.options()
        c.segment_reuse = "off" if opts is None else opts.mode
        if opts is not None:
            c.blend_ratio, c.blend_threshold = opts.ratio, opts.threshold
            c.blend_selection, c.blend_head_tokens = opts.selection, opts.head

    def generate(self, cfg: Config, prompt: dict):
        """TTFT and greedy tokens through the engine, caches as the mode would find them."""
        self.set_mode(cfg)
        self.engine.reset_prefix_cache()
        if cfg.kind != "full":
            self.llm.generate({"prompt_token_ids": self.head_ids}, SamplingParams(max_tokens=1))
        return self.llm.generate(prompt, self.greedy)[0]

    @property
    def head_ids(self) -> list[int]:
        return self.llm.tokenizer.encode(HEAD, add_special_tokens=False)

    def forced_logprobs(self, cfg: Config, prompt: dict, answer_ids: list[int]) -> torch.Tensor:
        """Log-probabilities ``[16, V]`` at the answer's positions, answer tokens forced."""
        sp = parse_segment_prompt(self.llm.tokenizer, prompt)
        ids = sp.token_ids + answer_ids[:-1]
        n = len(sp.token_ids)
        opts = replace(cfg.options() or BlendOptions("shift"), check_layer=self.check_layer)
        spans = () if cfg.kind in ("full", "prefix") else sp.spans
        fake = PlainRequest(f"forced-{time.monotonic_ns()}", ids)
        cache = self.engine.cache
        table = cache.allocate_slots(fake, len(ids))
        try:
            slots = self.engine.kv.slots(table, len(ids))
            res = self.engine.segment_reuse.blender.prefill(ids, spans, slots, 0, opts,
                                                            logits_positions=list(range(n - 1, len(ids))))
        finally:
            cache.free(fake)
        return torch.log_softmax(res.logits.float(), dim=-1)


def kl(ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(ref || lp) per row, from log-probabilities."""
    return (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)


def run(n_requests: int, check_layer: int = 2, seed: int = 0, kinds: set[str] | None = None,
        head: int = 0) -> list[Row]:
    h = Harness(check_layer)
    cfgs = [replace(c, head=head) for c in configs()
            if kinds is None or c.kind in kinds or c.kind == "full"]  # full: the reference
    stats: dict[str, dict[str, list[float]]] = {c.name: {} for c in cfgs}
    for i, (prompt, answer) in enumerate(requests(n_requests, seed)):
        ref_out = h.generate(cfgs[0], prompt)
        ref_lp = h.forced_logprobs(cfgs[0], prompt, ref_out.token_ids)
        for cfg in cfgs:
            out = ref_out if cfg.kind == "full" else h.generate(cfg, prompt)
            lp = ref_lp if cfg.kind == "full" else h.forced_logprobs(cfg, prompt, ref_out.token_ids)
            k = kl(ref_lp, lp)
            agree = sum(a == b for a, b in zip(out.token_ids, ref_out.token_ids)) / ANSWER_TOKENS
            s = stats[cfg.name]
            for key, val in [("ttft", out.metrics["ttft"]), ("kl_first", float(k[0])), ("kl_mean", float(k.mean())),
                             ("agree", agree), ("acc", float(answer.lower() in out.text.lower())),
                             ("reused", out.num_segment_tokens / len(out.prompt_token_ids))]:
                s.setdefault(key, []).append(val)
        print(f"request {i + 1}/{n_requests} done; prompt {len(ref_out.prompt_token_ids)} tokens", flush=True)
    full_ttft = statistics.median(stats[cfgs[0].name]["ttft"])
    rows = []
    for c in cfgs:
        s = stats[c.name]
        ttft = statistics.median(s["ttft"])
        rows.append(Row(c.name, c.kind, ttft * 1e3, full_ttft / ttft, statistics.mean(s["kl_first"]),
                        statistics.mean(s["kl_mean"]), statistics.mean(s["agree"]), statistics.mean(s["acc"]),
                        statistics.mean(s["reused"])))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| mode | TTFT ms (p50) | speedup | KL first token | mean KL (16, forced) | greedy agreement | "
             "accuracy | prompt tokens from segments |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.ttft_ms:.0f} | {r.speedup:.2f}x | {r.kl_first:.4f} | {r.kl_mean:.4f} | "
                     f"{r.agreement:.2f} | {r.accuracy:.2f} | {r.reused_frac:.2f} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    floor = 1e-4  # exact modes have KL ~0; draw them on the floor of the log axis
    for kind, style, label in [("blend", "o-", "blend (ratio r)"), ("attention", "d-", "attention-weighted"),
                               ("random", "s--", "random selection"),
                               ("threshold", "^:", "blend (threshold)")]:
        pts = sorted((r.ttft_ms, max(r.kl_mean, floor), r.name) for r in rows if r.kind == kind)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        for x, y, name in pts:
            ax.annotate(name.split(" ", 1)[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for kind, marker in [("shift", "X"), ("prefix", "P"), ("full", "*")]:
        r = next((r for r in rows if r.kind == kind), None)
        if r is None:
            continue
        ax.plot([r.ttft_ms], [max(r.kl_mean, floor)], marker, markersize=11, label=r.name)
    ax.set_xlabel("TTFT, ms (p50)")
    ax.set_ylabel("mean teacher-forced KL vs full prefill (16 tokens)")
    ax.set_yscale("log")
    ax.set_title("rag-reorder: 5 docs x ~300 tokens, SmolLM2-135M float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="10 questions, each with fresh document orders")
    ap.add_argument("--check-layer", type=int, default=2, help="the layer whose KV deviation picks tokens")
    ap.add_argument("--seed", type=int, default=0, help="seeds the document orders")
    ap.add_argument("--out", default="docs/blend")
    ap.add_argument("--kinds", default=None,
                    help="comma-separated modes to run (full prefill always runs): prefix, shift, blend, attention, "
                         "random, threshold (default: all)")
    ap.add_argument("--head", type=int, default=0, help="blend_head_tokens of every reuse mode")
    args = ap.parse_args()
    rows = run(args.requests, args.check_layer, args.seed, set(args.kinds.split(",")) if args.kinds else None,
               args.head)
    md = table(rows)
    print(md)
    out = Path(args.out)
    plot(rows, out / "pareto.png")
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"wrote {out / 'pareto.png'} and {out / 'results.json'}")


if __name__ == "__main__":
    main()
