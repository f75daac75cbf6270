"""The targets of issue 5, checked against what was measured (the table shows the truth either
way; this only says which ratios reached their target)."""

from __future__ import annotations

from dataclasses import dataclass

from .summary import PeerSummary

REUSE_WORKLOADS = ("shared-system-prompt", "multi-tenant")
THROUGHPUT_TARGETS = {"transformers": 3.0, "llama-cpp-ramcache": 1.5}
NO_REUSE_TOLERANCE = 0.03


@dataclass
class Check:
    what: str
    measured: str
    met: bool


def check_targets(rows: list[PeerSummary], reference: str) -> list[Check]:
    by = {(r.workload, r.peer): r for r in rows}
    checks = []
    for wl in REUSE_WORKLOADS:
        ref = by.get((wl, reference))
        if ref is None:
            continue
        for peer, target in THROUGHPUT_TARGETS.items():
            other = by.get((wl, peer))
            if other is None:
                continue
            ratio = ref.throughput / other.throughput
            paired = f"; paired median e2e {other.paired_e2e_ratio:.2f}x" if other.paired_e2e_ratio else ""
            checks.append(Check(f"{wl}: {reference} throughput >= {target:g}x {peer}",
                                f"{ratio:.2f}x{paired}", ratio >= target))
            if ref.ttft_hit_p50 and other.ttft_hit_p50:
                checks.append(Check(f"{wl}: TTFT p50 on hits below {peer}",
                                    f"{ref.ttft_hit_p50 * 1e3:.0f} ms vs {other.ttft_hit_p50 * 1e3:.0f} ms",
                                    ref.ttft_hit_p50 < other.ttft_hit_p50))
    on, off = by.get(("no-reuse", reference)), by.get(("no-reuse", "kvmosaic-none"))
    if on and off and off.throughput:
        ratio = on.throughput / off.throughput
        checks.append(Check(f"no-reuse: {reference} no more than {NO_REUSE_TOLERANCE:.0%} slower than kvmosaic-none",
                            f"{ratio:.3f}x throughput", ratio >= 1 - NO_REUSE_TOLERANCE))
    return checks
