"""PNG plots (matplotlib, Agg backend): TTFT against reusable prefix length, and throughput per
engine per workload."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .runner import RequestRecord  # noqa: E402
from .summary import PeerSummary  # noqa: E402

MARKERS = "osD^v<>P*X"


def _colors(peers: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {p: cmap(i % 10) for i, p in enumerate(peers)}


def ttft_vs_prefix(records: list[RequestRecord], path: Path) -> Path:
    peers = list(dict.fromkeys(r.peer for r in records))
    colors = _colors(peers)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, peer in enumerate(peers):
        recs = [r for r in records if r.peer == peer]
        ax.scatter([r.reusable_tokens for r in recs], [r.ttft * 1e3 for r in recs], label=peer,
                   color=colors[peer], marker=MARKERS[i % len(MARKERS)], s=28, alpha=0.75)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens shared with an earlier request (reusable prefix)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("Time to first token against reusable prefix length (all workloads)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def throughput_bars(rows: list[PeerSummary], path: Path) -> Path:
    workloads = list(dict.fromkeys(r.workload for r in rows))
    peers = list(dict.fromkeys(r.peer for r in rows))
    colors = _colors(peers)
    by = {(r.workload, r.peer): r.throughput for r in rows}
    width = 0.8 / len(peers)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(workloads)), 5), dpi=110)
    for j, peer in enumerate(peers):
        xs = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, [by.get((w, peer), 0.0) for w in workloads], width, label=peer, color=colors[peer])
    ax.set_xticks(range(len(workloads)), workloads, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("throughput: (prompt + generated tokens) / s, log scale")
    ax.set_title("Throughput per engine per workload (requests one at a time)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
