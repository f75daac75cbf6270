"""Results of ``kvmosaic bench serve`` (see :mod:`.serving`): one :class:`LevelResult` per (peer,
workload, load level) from its requests' :class:`~.serve_client.RequestResult`, and the report:
the markdown table with its definitions, and the plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .serve_client import RequestResult, inter_token_gaps

POOL_NOTE = (
    "KV pool: *blocks used* is the peak of kvmosaic's /health kv.num_used_blocks during the level, and *pool "
    "util.* the median over samples with requests running of kv.num_used_slots / kv.num_allocated_slots: slots "
    "holding a computed token among the slots of the blocks running requests hold (a shared block counts "
    "once). Servers without those fields get an estimate from client-side token counts, which can exceed 100% when "
    "requests share blocks."
)


# ---- statistics --------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass
class LevelResult:
    peer: str
    workload: str
    mode: str  # "closed" or "poisson"
    level: float  # concurrency, or request rate (req/s) for poisson
    requests: int
    failed: int
    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    output_tps: float
    total_tps: float
    blocks_used_peak: int | None = None
    num_blocks: int | None = None
    pool_util: float | None = None
    errors: list[str] = field(default_factory=list)
    usage_reported: bool = True  # False: some responses had no usage (cached tokens unknown)
    server_cpu_s: float | None = None  # user + system CPU seconds of the server's process tree during the level
    server_procs: int | None = None  # processes in that tree at the level's end
    # the read bandwidth (GB/s) measured right before and right after the level, where measured (the
    # decode share's level: machine_share.py); this VM's bandwidth moved ~2x between minutes
    read_gbs_around: tuple[float, float] | None = None
    # after the decode share's level: (read GB/s, ITL p50 s) of requests sent one at a time, each right
    # after a reading of its own (serve_client.paired_decode), so that a step and the bandwidth it is
    # a share of are measured in the same minute
    decode_pairs: list[tuple[float, float]] | None = None


def summarize_level(peer: str, workload: str, mode: str, level: float, results: list[RequestResult],
                    wall_s: float, pool: dict | None = None, cpu: tuple[float, int] | None = None) -> LevelResult:
    """``cpu``: (CPU seconds the server's process tree used during the level, its processes)."""
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in inter_token_gaps(r.chunk_times)]
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    pool = pool or {}
    return LevelResult(
        peer=peer, workload=workload, mode=mode, level=level, requests=len(ok), failed=len(results) - len(ok),
        wall_s=wall_s, prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens for r in ok),
        ttft_p50=percentile([r.ttft for r in ok if r.ttft is not None], 50),
        ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None], 99),
        itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99),
        output_tps=completion / wall_s if wall_s else 0.0, total_tps=(prompt + completion) / wall_s if wall_s else 0.0,
        blocks_used_peak=pool.get("blocks_used_peak"), num_blocks=pool.get("num_blocks"), pool_util=pool.get("pool_util"),
        errors=sorted({r.error for r in results if r.error})[:3],
        usage_reported=all(r.usage_reported for r in ok),
        server_cpu_s=cpu[0] if cpu else None, server_procs=cpu[1] if cpu else None,
    )


# ---- report ------------------------------------------------------------------------------------

COLUMNS = ("workload", "engine", "load", "reqs", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
           "output tok/s", "total tok/s", "cached tok", "blocks used (peak/pool)", "pool util.", "server CPU s (cores, procs)",
           "x best peer tok/s")


def format_ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1e3:,.0f}" if v >= 0.01 else f"{v * 1e3:.1f}"


def format_cpu(r: LevelResult) -> str:
    """``12.3 (1.9, 2)``: CPU seconds, their share of the level's wall time in cores, processes."""
    if r.server_cpu_s is None:
        return "–"
    cores = f"{r.server_cpu_s / r.wall_s:.1f}" if r.wall_s else "–"
    return f"{r.server_cpu_s:.1f} ({cores}, {r.server_procs})"


def load_label(r: LevelResult) -> str:
    return f"c={int(r.level)}" if r.mode == "closed" else f"{r.level:g} req/s"


def best_peer_ratios(rows: list[LevelResult], reference: str) -> dict[tuple, float]:
    """Per (workload, mode, level): the reference's total tok/s / the best other engine's
    (kvmosaic's own configurations and revisions are not peers)."""
    out = {}
    for r in rows:
        if r.peer != reference:
            continue
        others = [o.total_tps for o in rows if not o.peer.startswith("kvmosaic")
                  and (o.workload, o.mode, o.level) == (r.workload, r.mode, r.level) and o.total_tps]
        if others:
            out[(r.workload, r.mode, r.level)] = r.total_tps / max(others)
    return out


def table(rows: list[LevelResult], reference: str = "kvmosaic-hash") -> str:
    ratios = best_peer_ratios(rows, reference)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        share = f" ({r.cached_tokens / r.prompt_tokens:.0%})" if r.prompt_tokens else ""
        blocks = f"{r.blocks_used_peak}/{r.num_blocks}" if r.blocks_used_peak is not None else "–"
        util = f"{r.pool_util:.0%}" if r.pool_util is not None else "–"
        ratio = ratios.get((r.workload, r.mode, r.level)) if r.peer == reference else None
        reqs = f"{r.requests}" + (f" ({r.failed} failed)" if r.failed else "")
        cells = (r.workload, r.peer, load_label(r), reqs, format_ms(r.ttft_p50), format_ms(r.ttft_p99),
                 format_ms(r.itl_p50), format_ms(r.itl_p99), f"{r.output_tps:.0f}", f"{r.total_tps:.0f}",
                 f"{r.cached_tokens}{share}" if r.usage_reported else "n/a", blocks, util, format_cpu(r),
                 "–" if ratio is None else f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


DEFINITIONS = """\
- *load*: c=N is a closed loop of N clients (each sends its next request when its last one ended);
  "R req/s" is an open loop with Poisson arrivals at R requests per second.
- *TTFT*: from sending the request to the first streamed chunk with content, at the client.
- *ITL*: gaps between consecutive content chunks of a request (all requests of the level pooled).
- *output / total tok/s*: completion tokens / (prompt + completion tokens) of the level over its
  wall time (first request sent to last response ended), token counts from each response's usage;
  where a server sends no usage (llama-cpp-python), the prompt tokenized with the model's tokenizer
  and one token per content chunk.
- *cached tok*: sum of usage.prompt_tokens_details.cached_tokens (share of prompt tokens); n/a where
  the server does not report it.
- *server CPU s (cores, procs)*: user + system CPU seconds of the peer's server during the level, over
  its whole process tree (psutil: the server, its live children such as vLLM's engine core, and
  children it has reaped); *cores*: those seconds / the level's wall time; *procs*: processes in the
  tree at the level's end. A peer using more cores than `--threads` shows here.
- *x best peer tok/s*: the reference kvmosaic peer's total tok/s / the best other engine's at that load
  (kvmosaic's own configurations excluded).
"""


def render(rows: list[LevelResult], header: dict[str, str], skipped: list[str], plots: list[str],
           reference: str = "kvmosaic-hash", machine: str = "") -> str:
    """The report; ``machine``: the "at X% of the machine" section (:mod:`.machine_share`), if any."""
    parts = ["# kvmosaic bench serve", ""]
    parts += [f"- {k}: {v}" for k, v in header.items()]
    parts += [f"- skipped: {s}" for s in skipped]
    parts += ["", table(rows, reference), ""]
    parts += [machine, ""] if machine else []
    parts += ["## Definitions", "", DEFINITIONS, POOL_NOTE, ""]
    parts += [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def plot(rows: list[LevelResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = [r for r in rows if r.mode == "closed"]
    workloads = list(dict.fromkeys(r.workload for r in closed))
    peers = list(dict.fromkeys(r.peer for r in closed))
    cmap = plt.get_cmap("tab10")
    paths = []
    for metric, label, fname in (("total_tps", "total tok/s (prompt + output)", "serve_throughput.png"),
                                 ("ttft_p50", "TTFT p50 (ms)", "serve_ttft.png")):
        fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(6 * max(1, len(workloads)), 4.5), dpi=110, squeeze=False)
        for ax, wl in zip(axes[0], workloads or ["(none)"]):
            for i, peer in enumerate(peers):
                pts = sorted((r.level, getattr(r, metric)) for r in closed if r.workload == wl and r.peer == peer
                             and getattr(r, metric) is not None)
                if pts:
                    ys = [y * 1e3 if metric == "ttft_p50" else y for _, y in pts]
                    ax.plot([x for x, _ in pts], ys, marker="osD^v"[i % 5], label=peer, color=cmap(i % 10))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients (closed loop)")
            ax.set_ylabel(label)
            if metric == "ttft_p50":
                ax.set_yscale("log")
            ax.set_title(f"{wl}: {label.split(' (')[0]} against concurrency")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)
        paths.append(out / fname)
    return paths

