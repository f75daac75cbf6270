"""``kvmosaic bench serve``: a serving benchmark in the manner of vLLM's ``benchmark_serving``.

Each peer's HTTP server is started here (one at a time, on a free loopback port), warmed with one
request, then driven by streaming chat clients (``--client``: ``aiohttp`` reading the events as
``vllm bench serve`` does, by default, or the official ``openai`` ``AsyncOpenAI``):

- closed loop at each ``--concurrency`` level (N clients, each sends its next request when its
  previous one has finished), and, with ``--rate``, open loop with Poisson arrivals;
- the machine's roofline (:mod:`.roofline`) measured first, at the peers' threads, and each peer's
  prefill and decode at c=1 of no-reuse as fractions of it (:mod:`.machine_share`);
- workloads: ``shared-prefix`` (chat requests sharing one ~800-token system prompt, distinct short
  questions) and ``no-reuse`` (chat requests of about the same length with nothing in common).

Every (workload, load level) pair uses prompts of its own (a fresh system prompt per level), so a
level never hits blocks cached by an earlier level, on any peer, without a cache reset.

Measured per (peer, workload, level): TTFT p50/p99 (request sent to the first content chunk),
inter-token latency p50/p99 (gaps between content chunks after the first), output tok/s and total
(prompt + output) tok/s over the level's wall time, cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``), and for kvmosaic its KV pool, sampled from
``/health`` during the level (see :data:`POOL_NOTE`).

The parts: :mod:`.serve_workloads` (requests, sizes), :mod:`.serve_client` (the load generator),
:mod:`.serve_report` (per-level results, the table, the plots); this module starts the peers'
servers and runs the command line. Every name it had before the split is still importable here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from ..server.tokenizer import tokenizer_for
from .machine import describe
from .machine_share import SHARE_WORKLOAD, shares
from .machine_share import table as share_table
from .model_size import model_size
from .roofline import ReadProbe
from .roofline import measure as measure_roofline
from .serve_client import CLIENTS, PoolSampler, RequestResult, one_request, paired_decode, run_level
from .serve_peers import (  # re-exported (__all__)
    DEFAULT_SERVE_PEERS,
    KVMOSAIC_SERVE,
    SERVE_PEERS,
    ServerPeer,
    export_gguf,
    llama_server_argv,
    llama_server_binary,
    make_server_peer,
    unavailable_reason,
    vllm_argv,
    vllm_python,
)
from .serve_report import (
    COLUMNS,
    DEFINITIONS,
    POOL_NOTE,
    LevelResult,
    best_peer_ratios,
    format_cpu,
    format_ms,
    inter_token_gaps,
    load_label,
    percentile,
    plot,
    render,
    summarize_level,
    table,
)
from .serve_workloads import FULL, QUICK, SERVE_WORKLOADS, ServeSizes, prompt_tokens, serve_requests

__all__ = [
    "COLUMNS", "DEFAULT_SERVE_PEERS", "DEFINITIONS", "FULL", "KVMOSAIC_SERVE", "POOL_NOTE", "QUICK", "SERVE_PEERS",
    "SERVE_WORKLOADS", "LevelResult", "PoolSampler", "RequestResult", "ServeSizes", "ServerPeer",
    "add_serve_arguments", "best_peer_ratios", "command_line", "export_gguf", "format_cpu", "inter_token_gaps",
    "llama_server_argv", "llama_server_binary", "make_server_peer", "vllm_argv", "vllm_python",
    "one_request", "percentile", "plot", "prompt_tokens", "render", "run", "run_level", "serve_requests",
    "summarize_level", "table", "unavailable_reason",
]


# Requests of the decode share's level sent again one at a time, each after a bandwidth reading of its own
# (serve_client.paired_decode; machine_share.py's paired share)
PAIRED_REQUESTS = 8


# ---- command line ------------------------------------------------------------------------------

def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench serve (workload 'serve')")
    g.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4,16,32 (quick: 1,4)")
    g.add_argument("--rate", type=float, action="append", default=[],
                   help="also run open-loop Poisson arrivals at this many requests/s (repeatable)")
    g.add_argument("--requests", type=int, default=None, help="requests per level (default 32, quick 4; at least the concurrency)")
    g.add_argument("--serve-workloads", default=",".join(SERVE_WORKLOADS), help=f"from: {', '.join(SERVE_WORKLOADS)}")
    g.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 32, quick 8)")
    g.add_argument("--client", choices=CLIENTS, default=CLIENTS[0],
                   help="the streaming client: aiohttp reads each event line as vLLM's bench serve does; openai "
                        "is the official AsyncOpenAI, ~0.25 ms more CPU a chunk on the machine it measures")
    g.add_argument("--kvmosaic-args", default="", metavar="ARGS",
                   help="more `kvmosaic serve` flags for the kvmosaic peers, e.g. \"--max-num-batched-tokens 512\"")


def command_line(args: argparse.Namespace, peers: str) -> str:
    parts = ["kvmosaic bench serve", "--peers", peers, "--serve-workloads", args.serve_workloads, "--dtype", args.dtype]
    parts += ["--quick"] if args.quick else []
    parts += ["--concurrency", args.concurrency] if args.concurrency else []
    parts += [x for r in args.rate for x in ("--rate", f"{r:g}")]
    parts += ["--requests", str(args.requests)] if args.requests else []
    parts += ["--max-tokens", str(args.max_tokens)] if args.max_tokens else []
    parts += ["--threads", str(args.threads)] if args.threads else []
    parts += ["--seed", str(args.seed)] if args.seed else []
    parts += ["--kvmosaic-args", shlex.quote(args.kvmosaic_args)] if args.kvmosaic_args else []
    parts += ["--client", args.client] if args.client != CLIENTS[0] else []
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = QUICK if args.quick else FULL
    sizes = ServeSizes(system_words=base.system_words, max_tokens=args.max_tokens or base.max_tokens,
                       requests=args.requests or base.requests,
                       concurrency=tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else base.concurrency)
    peers_arg = args.peers if args.peers_given else ",".join(DEFAULT_SERVE_PEERS)
    workloads = [w.strip() for w in args.serve_workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in SERVE_WORKLOADS:
            print(f"unknown serving workload {w!r}; choose from {', '.join(SERVE_WORKLOADS)}")
            return 2
    skipped: list[str] = []
    names = []
    for name in (n.strip() for n in peers_arg.split(",") if n.strip()):
        reason = unavailable_reason(name)
        if reason:
            print(reason)
            skipped.append(reason)
        else:
            names.append(name)
    tokenizer = tokenizer_for(args.model)
    levels: list[tuple[str, float]] = [("closed", c) for c in sizes.concurrency] + [("poisson", r) for r in args.rate]
    plan = []  # (workload, mode, level, messages, prompt token estimates)
    for wl in workloads:
        for mode, level in levels:
            n = max(sizes.requests, int(level)) if mode == "closed" else max(sizes.requests, 8)
            convs = serve_requests(wl, n, sizes, args.seed, f"{mode}-{level:g}")
            lens = [prompt_tokens(tokenizer, c) for c in convs]
            plan.append((wl, mode, level, convs, lens))
    started = time.time()
    # The machine's ceilings, measured once before any server starts, with the peers' threads.
    roofline = measure_roofline(args.threads, args.model, args.quick)
    for line in roofline.lines():
        print(line, flush=True)
    try:
        size = model_size(args.model)
    except (OSError, ValueError, KeyError) as err:  # a model whose files this reader does not know
        size = None
        skipped.append(f"machine shares: the model's parameter count could not be read ({err})")
    rows: list[LevelResult] = []
    peer_times: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        peer = make_server_peer(name, args.dtype, args.threads, args.model, args.kvmosaic_args)
        try:
            print(f"starting {name} ...", flush=True)
            peer.start()
            print(f"{name} ready at {peer.url} (model {peer.model}) after {time.perf_counter() - t0:.0f} s", flush=True)
            warm = asyncio.run(run_level(peer, [[{"role": "user", "content": "Warm-up: say hello."}]], 2, 1, None,
                                         args.seed, [8], args.client))[0]
            if not warm or not warm[0].ok:
                raise RuntimeError(f"warm-up request failed: {warm[0].error if warm else 'no result'}")
            for wl, mode, level, convs, lens in plan:
                share_level = (wl, mode, level) == (SHARE_WORKLOAD, "closed", 1)
                probe = ReadProbe(args.threads, args.quick) if share_level else None
                read_before = probe.read() if probe else None
                cpu0 = peer.cpu_seconds()
                res, wall, pool = asyncio.run(run_level(peer, convs, sizes.max_tokens, int(level) if mode == "closed" else None,
                                                        level if mode == "poisson" else None, args.seed, lens,
                                                        args.client))
                cpu1 = peer.cpu_seconds()
                cpu = (cpu1[0] - cpu0[0], cpu1[1]) if cpu0 and cpu1 else None
                row = summarize_level(name, wl, mode, level, res, wall, pool, cpu)
                if probe is not None:
                    row.read_gbs_around = (read_before, probe.read())
                    row.decode_pairs = asyncio.run(paired_decode(peer, convs[:PAIRED_REQUESTS], sizes.max_tokens,
                                                                 args.client, probe.read))
                    probe = None  # its buffer freed before the next level
                rows.append(row)
                # partial results survive an interrupted run
                (out / "serve.partial.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
                print(f"  {wl} {load_label(row)}: {row.requests} ok, {row.failed} failed, TTFT p50 {format_ms(row.ttft_p50)} ms, "
                      f"total {row.total_tps:.0f} tok/s, cached {row.cached_tokens}/{row.prompt_tokens}, "
                      f"server CPU {format_cpu(row)}"
                      + (f"; errors: {row.errors}" if row.errors else ""), flush=True)
        except (RuntimeError, TimeoutError, OSError) as err:
            skipped.append(f"{name} could not run: {str(err)[:600]}")
            print(skipped[-1], flush=True)
        finally:
            peer.stop()
        peer_times[name] = time.perf_counter() - t0
    ran = {r.peer for r in rows}
    reference = next((n for n in (args.reference, "kvmosaic-hash", "kvmosaic-radix") if n in ran), "kvmosaic-hash")
    pngs = plot(rows, out) if rows else []
    prompt_example = plan[0][4][0] if plan else 0
    header = {
        "command": f"`{command_line(args, peers_arg)}`",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": describe(),
        "requests": (f"chat, {sizes.max_tokens} output tokens (greedy; all but transformers serve ignore EOS), "
                     f"first workload's prompt {prompt_example} tokens, {sizes.requests} requests per level "
                     f"(at least the concurrency), a fresh system prompt per level"),
        "reference for ratios": reference,
        "client": f"{args.client}, streaming",
        "wall time": f"{time.time() - started:.0f} s ("
                     + ", ".join(f"{n} {t:.0f} s" for n, t in peer_times.items()) + ", server start included)",
    }
    machine = shares(rows, roofline, size, args.dtype) if size else []
    md = render(rows, header, skipped, [p.name for p in pngs], reference,
                machine=share_table(machine, roofline, args.dtype) if size else "")
    (out / "serve.md").write_text(md)
    (out / "serve.json").write_text(json.dumps({"header": header, "skipped": skipped,
                                                "rows": [asdict(r) for r in rows], "roofline": asdict(roofline),
                                                "machine_share": [asdict(m) for m in machine]}, indent=1))
    print(md)
    print(f"wrote {out}/serve.md, serve.json" + "".join(f", {p.name}" for p in pngs))
    return 0 if rows else 1
