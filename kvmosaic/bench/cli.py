"""``kvmosaic bench WORKLOAD [--peers ...] [--quick] [--seed N] [--out results/]``, and
``kvmosaic bench serve [--concurrency 1,4,16,32] [--rate R]``: the serving benchmark of
:mod:`.serving` (HTTP servers driven by openai clients); ``kvmosaic bench scale``: one server
against replicas on the same cores (:mod:`.scale`); ``kvmosaic bench roofline``: this machine's
GEMM peak and memory bandwidth (:mod:`.roofline`).

Runs the workloads of docs/ARCHITECTURE.md on kvmosaic and its peers (each in its own worker process,
loaded once, requests interleaved), prints a markdown table and writes it, a JSON dump of every
request and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from ..server.tokenizer import tokenizer_for
from . import plots, report
from .benchmarks_md import publish
from .machine import describe
from .peers import ALL_PEERS, DEFAULT_PEERS, QUICK_PEERS, PeerSettings, unavailable_reason
from .runner import run_workload, warm_up
from .summary import pick_reference, summarize
from .targets import check_targets
from .worker import PeerProcess
from .workloads import BUILDERS, build


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .scale import add_scale_arguments
    from .serving import SERVE_PEERS, add_serve_arguments

    p.add_argument("workload", choices=[*BUILDERS, "all", "serve", "batch-16", "scale", "roofline"],
                   help="a benchmark workload (docs/ARCHITECTURE.md), all, serve (the serving benchmark), batch-16 "
                        "(16 shared-prefix prompts submitted together), scale (one server vs replicas) or roofline (this "
                        "machine's GEMM peak per dtype and memory bandwidth at --threads)")
    p.add_argument("--peers", default=None,
                   help=f"comma-separated, from: {', '.join(ALL_PEERS)} (default: all but kvmosaic-hash-int8; with --quick: "
                        f"{', '.join(QUICK_PEERS)}); "
                        f"for serve: {', '.join(SERVE_PEERS)}, or kvmosaic-hash@PATH (a kvmosaic peer served from the "
                        f"checkout at PATH, e.g. an earlier revision)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--seed", type=int, default=0, help="fixes every prompt of every workload")
    p.add_argument("--out", default="results", help="folder for bench.md, bench.json and the plots")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default bfloat16; float32 with --quick (bfloat16 is several times slower on CPUs without "
                        "native bfloat16, and --quick must finish in under a minute)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per peer (default: all cores)")
    p.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    p.add_argument("--reference", default="kvmosaic-hash", help="kvmosaic peer the ratios are taken against")
    p.add_argument("--benchmarks-md", default=None, metavar="PATH",
                   help="also write the table and plots into this file's issue-5 section (plots to docs/bench/)")
    add_serve_arguments(p)
    add_scale_arguments(p)


def command_line(args: argparse.Namespace) -> str:
    parts = ["kvmosaic bench", args.workload, "--peers", args.peers, "--seed", str(args.seed), "--dtype", args.dtype]
    parts += ["--quick"] if args.quick else []
    parts += ["--threads", str(args.threads)] if args.threads else []
    parts += ["--model", args.model] if args.model else []
    parts += ["--out", args.out] if args.out != "results" else []
    parts += ["--benchmarks-md", args.benchmarks_md] if args.benchmarks_md else []
    return " ".join(parts)


def start_peers(names: list[str], settings: PeerSettings, skipped: list[str]) -> dict[str, PeerProcess]:
    procs = {n: PeerProcess(n, settings) for n in names}
    ready = {}
    for name, proc in procs.items():
        try:
            info = proc.wait_ready()
            print(f"loaded {name}: +{info['load_mb']:.0f} MB")
            ready[name] = proc
        except RuntimeError as err:
            skipped.append(f"{name} failed to load: {str(err).strip().splitlines()[-1]}")
            print(skipped[-1])
            proc.stop()
    return ready


def run(args: argparse.Namespace) -> int:
    args.peers_given = args.peers is not None
    args.dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    if args.workload == "serve":
        from .serving import run as run_serve

        return run_serve(args)
    if args.workload == "batch-16":
        from .batch import run as run_batch

        return run_batch(args)
    if args.workload == "roofline":
        from .roofline import run as run_roofline

        return run_roofline(args)
    if args.workload == "scale":
        from .scale import run as run_scale

        return run_scale(args)
    args.peers = args.peers or ",".join(QUICK_PEERS if args.quick else DEFAULT_PEERS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped: list[str] = []
    wanted = [n.strip() for n in args.peers.split(",") if n.strip()]
    names = []
    for name in wanted:
        reason = unavailable_reason(name)
        if reason:
            print(reason)
            skipped.append(reason)
        else:
            names.append(name)
    if not names:
        print("no peer can run")
        return 1
    workloads = [build(w, args.seed, args.quick) for w in (BUILDERS if args.workload == "all" else [args.workload])]
    settings = PeerSettings(dtype=args.dtype, threads=args.threads, model_path=args.model)
    tokenizer = tokenizer_for(args.model)
    started = time.time()
    peers = start_peers(names, settings, skipped)
    try:
        warm_up(peers, tokenizer)
        runs = [run_workload(w, peers, tokenizer) for w in workloads]
    finally:
        for p in peers.values():
            p.stop()
    reference = pick_reference(list(peers), args.reference)
    rows = [row for r in runs for row in summarize(r, reference)]
    checks = check_targets(rows, reference) if reference else []
    records = [rec for r in runs for rec in r.records]
    pngs = [plots.ttft_vs_prefix(records, out / "ttft_vs_prefix.png"), plots.throughput_bars(rows, out / "throughput.png")]
    header = {
        "command": f"`{command_line(args)}`",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": describe(),
        "reference for ratios": reference or "none",
        "wall time": f"{time.time() - started:.0f} s",
    }
    md = report.render(rows, checks, header, skipped, [p.name for p in pngs])
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps({"header": header, "skipped": skipped,
                                                "rows": [asdict(r) for r in rows],
                                                "records": [asdict(r) for r in records]}, indent=1))
    print(md)
    if args.benchmarks_md:
        plot_dir = publish(Path(args.benchmarks_md), md, pngs)
        print(f"updated {args.benchmarks_md} and {plot_dir}/")
    print(f"wrote {out}/bench.md, bench.json, {', '.join(p.name for p in pngs)}")
    return 0
