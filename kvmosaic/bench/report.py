"""The markdown report: settings, the table of every workload and peer, targets, definitions."""

from __future__ import annotations

from .summary import DEFINITIONS, PeerSummary
from .targets import Check

COLUMNS = ("workload", "engine", "reqs", "prompt tok", "reused tok", "TTFT p50 ms", "TTFT p99 ms",
           "TTFT p50 hits ms", "e2e s", "tok/s", "peak MB", "kvmosaic x tok/s", "kvmosaic x e2e paired", "kvmosaic x TTFT hits")


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1e3:.0f}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def table(rows: list[PeerSummary]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        share = f" ({r.reused_tokens / r.prompt_tokens:.0%})" if r.prompt_tokens else ""
        cells = (r.workload, r.peer, str(r.requests), str(r.prompt_tokens), f"{r.reused_tokens}{share}",
                 _ms(r.ttft_p50), _ms(r.ttft_p99), _ms(r.ttft_hit_p50), f"{r.e2e_total:.1f}",
                 f"{r.throughput:.0f}", f"{r.peak_mb:.0f}", _x(r.throughput_ratio), _x(r.paired_e2e_ratio), _x(r.ttft_hit_ratio))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_section(checks: list[Check]) -> str:
    if not checks:
        return "No target could be checked (a peer it needs did not run)."
    return "\n".join(f"- {'met' if c.met else 'MISSED'}: {c.what} — {c.measured}" for c in checks)


def render(rows: list[PeerSummary], checks: list[Check], header: dict[str, str], skipped: list[str],
           plots: list[str]) -> str:
    parts = ["# kvmosaic bench", ""]
    parts += [f"- {k}: {v}" for k, v in header.items()]
    parts += [f"- skipped: {s}" for s in skipped]
    parts += ["", table(rows), "", "## Targets (issue 5)", "", targets_section(checks), "",
              "## Definitions", "", DEFINITIONS, ""]
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"
