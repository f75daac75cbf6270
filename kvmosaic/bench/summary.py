"""Per workload and peer: tokens reused, TTFT percentiles, end-to-end time, throughput, memory,
and the ratios of the reference kvmosaic configuration to each peer (see ``DEFINITIONS``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .runner import RequestRecord, WorkloadRun

HIT_MIN_TOKENS = 16

DEFINITIONS = f"""\
- *hits*: requests whose prompt shares at least {HIT_MIN_TOKENS} leading tokens with an earlier
  prompt (plus its generated tokens) of the same workload, on the same engine: the requests a
  prefix cache can serve. "TTFT p50 hits" is over those.
- *TTFT*: from the call to the first generated token being available to Python (kvmosaic: the
  engine step that returns it; transformers: prefill forward + argmax; llama-cpp-python: its
  sampler returning the first token). Requests run one at a time, greedy, exactly the workload's
  number of output tokens (EOS does not stop them).
- *reused tok*: prompt tokens the engine did not prefill, as it reports them (llama-cpp-python:
  the longer of its live context's and its RAM cache's common prefix with the prompt).
- *tok/s*: (prompt + generated tokens) / sum of end-to-end times.
- *peak MB*: the engine's worker process (one per engine), peak RSS during the workload minus
  its RSS before the model was loaded: weights, KV caches (kvmosaic preallocates its KV pool),
  activations.
- *kvmosaic x*: the reference's throughput divided by this engine's, and this engine's TTFT p50
  on hits divided by the reference's: above 1 means kvmosaic is faster. *paired* is the median,
  over requests, of this engine's end-to-end time divided by the reference's on the same request
  (run back to back): it shrugs off bursts of load from other jobs that hit a few requests."""


@dataclass
class PeerSummary:
    workload: str
    peer: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    reused_tokens: int
    reusable_tokens: int
    ttft_p50: float
    ttft_p99: float
    ttft_hit_p50: float | None
    e2e_total: float
    throughput: float
    peak_mb: float
    throughput_ratio: float | None = None  # reference / this peer
    ttft_hit_ratio: float | None = None  # this peer / reference
    paired_e2e_ratio: float | None = None  # median over requests of this peer's e2e / reference's


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_peer(run: WorkloadRun, peer: str) -> PeerSummary:
    recs: list[RequestRecord] = [r for r in run.records if r.peer == peer]
    hits = [r.ttft for r in recs if r.reusable_tokens >= HIT_MIN_TOKENS]
    tokens = sum(r.prompt_tokens + r.generated_tokens for r in recs)
    e2e = sum(r.e2e for r in recs)
    return PeerSummary(
        workload=run.workload.name, peer=peer, requests=len(recs),
        prompt_tokens=sum(r.prompt_tokens for r in recs),
        generated_tokens=sum(r.generated_tokens for r in recs),
        reused_tokens=sum(r.cached_tokens for r in recs),
        reusable_tokens=sum(r.reusable_tokens for r in recs),
        ttft_p50=_percentile([r.ttft for r in recs], 50), ttft_p99=_percentile([r.ttft for r in recs], 99),
        ttft_hit_p50=_percentile(hits, 50), e2e_total=e2e, throughput=tokens / e2e if e2e else 0.0,
        peak_mb=run.peak_mb.get(peer, float("nan")),
    )


def paired_e2e_ratio(run: WorkloadRun, peer: str, reference: str) -> float | None:
    """Median over requests of peer e2e / reference e2e: each pair ran back to back, so a
    burst of load from other jobs falls on both, and the median ignores the rest."""
    ref = {r.index: r.e2e for r in run.records if r.peer == reference}
    ratios = [r.e2e / ref[r.index] for r in run.records if r.peer == peer and ref.get(r.index)]
    return _percentile(ratios, 50)


def summarize(run: WorkloadRun, reference: str | None) -> list[PeerSummary]:
    peers = list(dict.fromkeys(r.peer for r in run.records))
    rows = [summarize_peer(run, p) for p in peers]
    ref = next((r for r in rows if r.peer == reference), None)
    for row in rows:
        if ref is None:
            continue
        if row.throughput:
            row.throughput_ratio = ref.throughput / row.throughput
        if row.ttft_hit_p50 and ref.ttft_hit_p50:
            row.ttft_hit_ratio = row.ttft_hit_p50 / ref.ttft_hit_p50
        row.paired_e2e_ratio = paired_e2e_ratio(run, row.peer, reference)
    return rows


def pick_reference(peers: list[str], wanted: str | None) -> str | None:
    """The kvmosaic configuration the ratios are taken against: ``wanted`` if it ran, else the
    first kvmosaic peer with a cache, else any kvmosaic peer."""
    if wanted in peers:
        return wanted
    cached = [p for p in peers if p.startswith("kvmosaic") and p != "kvmosaic-none"]
    return (cached or [p for p in peers if p.startswith("kvmosaic")] or [None])[0]
