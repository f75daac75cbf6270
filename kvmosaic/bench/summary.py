"""Per workload and peer: tokens reused, TTFT percentiles, end-to-end time, throughput, memory,
and the ratios of the reference kvmosaic configuration to each peer.

Definitions (also printed under the table):
- *hits*: requests whose prompt shares at least ``HIT_MIN_TOKENS`` leading tokens with an
  earlier prompt (plus its generated tokens) of the same workload — the requests a prefix cache
  can serve; "TTFT p50 hits" is over those.
- *throughput*: (prompt + generated tokens) / sum of end-to-end times, requests run one at a time.
- *x kvmosaic*: throughput of the reference divided by the peer's, and the peer's TTFT p50 on hits
  divided by the reference's: above 1 means kvmosaic is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .runner import RequestRecord, WorkloadRun

HIT_MIN_TOKENS = 16


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
    return rows


def pick_reference(peers: list[str], wanted: str | None) -> str | None:
    """The kvmosaic configuration the ratios are taken against: ``wanted`` if it ran, else the
    first kvmosaic peer with a cache, else any kvmosaic peer."""
    if wanted in peers:
        return wanted
    cached = [p for p in peers if p.startswith("kvmosaic") and p != "kvmosaic-none"]
    return (cached or [p for p in peers if p.startswith("kvmosaic")] or [None])[0]
