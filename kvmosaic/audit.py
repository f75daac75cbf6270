"""``kvmosaic audit``: does this server let one tenant learn another's prompts through the cache?

It plays both parts against a live server with two API keys. Per secret length L and per probe,
the *victim* sends a fresh random secret of L tokens (so the server caches it in the victim's
namespace); the *attacker* then sends, in random order, the true secret and a wrong one of the
same length (each followed by a short random suffix) and times the first streamed chunk (TTFT).
From the two samples it reports:

* **AUC**: the probability that a true probe answers faster than a wrong one (Mann-Whitney):
  0.5 is no leak, 1.0 a perfect oracle;
* **KS**: the two-sample Kolmogorov-Smirnov statistic and its p-value (as Gu et al. test
  providers), computed with numpy (scipy's exact value when scipy is installed);
* **cached_tokens**: whether the prompt tokens reused (``usage.prompt_tokens_details``'s
  ``cached_tokens``, plus ``segment_tokens`` and ``auto_reused_tokens`` where the server reports
  them) are more on true probes than on wrong ones (a direct oracle);
* **order**: true and wrong probes sent together; how often the true one answers first
  (longest-prefix-first scheduling reorders by cached length): 0.5 is no leak;
* **miss reasons** (issue 23): every probe asks for ``usage.prompt_tokens_details.miss_reasons``;
  for each reason, the AUC of its token count between true and wrong probes, taken two-sided
  (the attacker may read either direction): the largest is reported; a ``namespace`` reason
  shown to a tenant at all is a leak. None when the server does not return the field.

A length *leaks* when AUC > ``--auc-threshold`` (0.6), the KS p-value < 0.01, cached tokens
differ, the miss-reason AUC exceeds the threshold or ``namespace`` is shown, or the order share
exceeds 0.75. The command exits 1 when any length leaks. Prompts are
token ids (``/v1/completions``), so lengths are exact whatever the tokenizer.

``--head-tokens N`` puts N fresh random tokens before every secret and probe, so that no prefix
match reaches the secret: it audits reuse at any position (``--segment-reuse auto``, issue 24).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

REUSE_FIELDS = ("cached_tokens", "segment_tokens", "auto_reused_tokens")  # prompt tokens not computed
VOCAB = (1000, 40000)  # token ids drawn from here: ordinary tokens of any recent vocabulary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--attacker-key", required=True)
    p.add_argument("--victim-key", required=True)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--lengths", default="16,64,256", help="secret lengths in tokens, comma-separated")
    p.add_argument("--probes", type=int, default=40, help="probes per arm and length")
    p.add_argument("--order-pairs", type=int, default=None, help="concurrent pairs for the order test "
                   "(default: probes // 4, at least 4; 0 skips it)")
    p.add_argument("--suffix", type=int, default=4, help="random tokens after each secret")
    p.add_argument("--head-tokens", type=int, default=0, help="fresh random tokens before each secret and "
                   "probe: audits reuse away from the prefix (--segment-reuse auto)")
    p.add_argument("--auc-threshold", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="audit.png", help="where to save the TTFT plot ('' for none)")
    p.add_argument("--json", default=None, help="also write the results here")


# ---- statistics ---------------------------------------------------------------------------
def roc_auc(pos: list[float], neg: list[float]) -> float:
    """P(score(pos) > score(neg)) + 0.5 P(tie): the ROC AUC of a threshold on the score."""
    if not pos or not neg:
        return float("nan")
    x = np.concatenate([pos, neg])
    order = x.argsort(kind="mergesort")
    ranks = np.empty(len(x))
    sx = x[order]
    i = 0
    while i < len(x):  # average ranks over ties
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D and its p-value (scipy when installed, else
    the asymptotic Kolmogorov distribution with Stephens' small-sample correction)."""
    try:
        from scipy.stats import ks_2samp as scipy_ks  # type: ignore[import-not-found]

        r = scipy_ks(a, b)
        return float(r.statistic), float(r.pvalue)
    except ImportError:
        pass
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    d = float(np.max(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b))))
    en = math.sqrt(len(a) * len(b) / (len(a) + len(b)))
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 0.3:  # the series does not converge there; Q_KS(lam) is 1 to 1e-6
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, float(min(1.0, max(0.0, p)))


# ---- probing ------------------------------------------------------------------------------
@dataclass
class Probe:
    ttft: float
    cached: int | None
    misses: dict | None = None  # usage.prompt_tokens_details.miss_reasons


def miss_reason_auc(true: list[Probe], wrong: list[Probe]) -> tuple[float | None, bool]:
    """The most telling reason's two-sided AUC between true and wrong probes (None: the server
    returned no miss reasons), and whether any probe was shown the ``namespace`` reason."""
    if not any(p.misses is not None for p in true + wrong):
        return None, False
    reasons = {r for p in true + wrong for r in (p.misses or {})}
    best = 0.5
    for r in reasons:
        auc = roc_auc([(p.misses or {}).get(r, 0) for p in true], [(p.misses or {}).get(r, 0) for p in wrong])
        best = max(best, auc, 1 - auc)
    return best, "namespace" in reasons


@dataclass
class LengthResult:
    length: int
    probes: int
    auc: float
    ks_d: float
    ks_p: float
    cached_true: float
    cached_wrong: float
    cached_leak: bool
    order_share: float | None
    ttft_true_ms: list[float] = field(default_factory=list)
    ttft_wrong_ms: list[float] = field(default_factory=list)
    miss_auc: float | None = None
    namespace_shown: bool = False

    def leaks(self, auc_threshold: float = 0.6) -> bool:
        return (self.auc > auc_threshold or self.ks_p < 0.01 or self.cached_leak
                or (self.miss_auc is not None and self.miss_auc > auc_threshold) or self.namespace_shown
                or (self.order_share is not None and self.order_share > 0.75))


class Auditor:
    def __init__(self, url: str, attacker_key: str, victim_key: str, model: str | None = None,
                 suffix: int = 4, seed: int = 0, prefix: list[int] | None = None, head: int = 0) -> None:
        """``prefix``: token ids sent before every secret and probe (e.g. an operator-registered
        public system prompt, to audit ``shared-public`` mode: the secret is the private text
        after it, and the shared public head must not help the attacker); ``head``: fresh random
        tokens after it, different in every request (see the module docstring)."""
        import openai

        base = url.rstrip("/") + "/v1"
        self.attacker = openai.OpenAI(base_url=base, api_key=attacker_key, max_retries=0, timeout=600)
        self.victim = openai.OpenAI(base_url=base, api_key=victim_key, max_retries=0, timeout=600)
        self.model = model or self.attacker.models.list().data[0].id
        self.suffix = suffix
        self.prefix = list(prefix or [])
        self.head = head
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*VOCAB) for _ in range(n)]

    def send(self, client, prompt: list[int]) -> Probe:
        prompt = self.prefix + self.tokens(self.head) + prompt
        t0 = time.perf_counter()
        ttft, cached, misses = None, None, None
        stream = client.completions.create(model=self.model, prompt=prompt, max_tokens=1, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"return_miss_reasons": True})
        for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                cached = (sum(getattr(details, f, None) or 0 for f in REUSE_FIELDS)
                          if details is not None else None)
                misses = getattr(details, "miss_reasons", None) if details is not None else None
        return Probe(ttft if ttft is not None else time.perf_counter() - t0, cached, misses)

    def probe_length(self, length: int, probes: int, order_pairs: int) -> LengthResult:
        true, wrong = [], []
        self.send(self.attacker, self.tokens(length + self.suffix))  # warm the path for this length
        for _ in range(probes):
            secret = self.tokens(length)
            self.send(self.victim, secret + self.tokens(self.suffix))
            arms = [("true", secret), ("wrong", self.tokens(length))]
            self.rng.shuffle(arms)
            for arm, head in arms:
                p = self.send(self.attacker, head + self.tokens(self.suffix))
                (true if arm == "true" else wrong).append(p)
        # faster = more likely cached: the score is -TTFT
        auc = roc_auc([-p.ttft for p in true], [-p.ttft for p in wrong])
        d, pval = ks_2samp([p.ttft for p in true], [p.ttft for p in wrong])
        ct = [p.cached or 0 for p in true]
        cw = [p.cached or 0 for p in wrong]
        order = self.order_test(length, order_pairs) if order_pairs else None
        miss_auc, namespace_shown = miss_reason_auc(true, wrong)
        return LengthResult(length, probes, auc, d, pval, float(np.mean(ct)), float(np.mean(cw)),
                            float(np.mean(ct)) > float(np.mean(cw)), order,
                            [p.ttft * 1e3 for p in true], [p.ttft * 1e3 for p in wrong], miss_auc, namespace_shown)

    def order_test(self, length: int, pairs: int) -> float:
        """Send the true and a wrong probe together; the share of pairs the true one wins."""
        wins = 0
        for _ in range(pairs):
            secret = self.tokens(length)
            self.send(self.victim, secret + self.tokens(self.suffix))
            prompts = {"true": secret + self.tokens(self.suffix), "wrong": self.tokens(length + self.suffix)}
            done: list[str] = []
            lock = threading.Lock()

            def go(arm: str, prompts=prompts, done=done, lock=lock) -> None:
                self.send(self.attacker, prompts[arm])
                with lock:
                    done.append(arm)

            threads = [threading.Thread(target=go, args=(arm,)) for arm in self.rng.sample(list(prompts), 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wins += done[0] == "true"
        return wins / pairs

    def run(self, lengths: list[int], probes: int, order_pairs: int) -> list[LengthResult]:
        return [self.probe_length(n, probes, order_pairs) for n in lengths]


# ---- report -------------------------------------------------------------------------------
def table(results: list[LengthResult], auc_threshold: float = 0.6) -> str:
    lines = ["| secret tokens | probes/arm | TTFT AUC | KS D | KS p | cached_tokens true/wrong | miss_reasons AUC "
             "| order share | median TTFT true/wrong (ms) | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        order = "-" if r.order_share is None else f"{r.order_share:.2f}"
        miss = "-" if r.miss_auc is None else f"{r.miss_auc:.2f}{' (namespace shown: LEAK)' if r.namespace_shown else ''}"
        lines.append(f"| {r.length} | {r.probes} | {r.auc:.2f} | {r.ks_d:.2f} | {r.ks_p:.2g} | "
                     f"{r.cached_true:.1f} / {r.cached_wrong:.1f}{' (LEAK)' if r.cached_leak else ''} | {miss} | {order} | "
                     f"{np.median(r.ttft_true_ms):.0f} / {np.median(r.ttft_wrong_ms):.0f} | "
                     f"{'LEAKS' if r.leaks(auc_threshold) else 'no leak detected'} |")
    return "\n".join(lines)


def plot(results: list[LengthResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        bins = np.linspace(min(r.ttft_true_ms + r.ttft_wrong_ms), max(r.ttft_true_ms + r.ttft_wrong_ms), 25)
        ax.hist(r.ttft_wrong_ms, bins=bins, alpha=0.6, label="wrong prefix")
        ax.hist(r.ttft_true_ms, bins=bins, alpha=0.6, label="victim's prefix")
        ax.set_title(f"{r.length} tokens: AUC {r.auc:.2f}")
        ax.set_xlabel("attacker TTFT (ms)")
    axes[0][0].set_ylabel("probes")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    pairs = args.order_pairs if args.order_pairs is not None else max(4, args.probes // 4)
    auditor = Auditor(args.url, args.attacker_key, args.victim_key, args.model, args.suffix, args.seed,
                      head=args.head_tokens)
    results = auditor.run(lengths, args.probes, pairs)
    print(table(results, args.auc_threshold))
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    leaks = [r.length for r in results if r.leaks(args.auc_threshold)]
    print(f"\n{'LEAK at ' + ', '.join(map(str, leaks)) + ' tokens' if leaks else 'no leak detected'}")
    return 1 if leaks else 0
