"""What the benchmark's streaming client costs the server it measures: ``kvmosaic bench serve``'s
two clients (``--client aiohttp``, each event line parsed as vLLM's ``vllm bench serve`` does, and
``--client openai``, the official ``AsyncOpenAI``) alternated against one ``kvmosaic serve``.

On a two-core machine the client's CPU comes out of the server's decode. Each round sends
``--requests`` streamed chat requests at c = 1 through each client, in alternating order, and
prints per client the ITL p50 and the client's own CPU time per streamed chunk
(``time.process_time``: the load generator runs in this process). Run:
``python -m benchmarks.client_cost`` from the repository root (``--rounds``, ``--requests``,
``--max-tokens``, ``--dtype``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from kvmosaic.bench.machine import describe
from kvmosaic.bench.serve_client import CLIENTS, inter_token_gaps, run_level
from kvmosaic.bench.serve_peers import make_server_peer


def one_round(peer, kind: str, first: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """ITL p50 (ms) and client CPU per content chunk (ms) of ``requests`` streams through ``kind``, one after
    the other through one client (as a level of ``kvmosaic bench serve`` at c = 1)."""
    convs = [[{"role": "user", "content": f"Question {k}: tell me a story about the number {k}."}]
             for k in range(first, first + requests)]
    cpu = time.process_time()
    results, _, _ = asyncio.run(run_level(peer, convs, max_tokens, 1, None, 0, [0] * requests, kind))
    cpu = time.process_time() - cpu
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{kind}: {failed[0]}")
    gaps = [g for r in results for g in inter_token_gaps(r.chunk_times)]
    return 1e3 * statistics.median(gaps), 1e3 * cpu / max(sum(len(r.chunk_times) for r in results), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8, help="streams per client per round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    print(describe())
    peer = make_server_peer("kvmosaic-hash", args.dtype, None, None)
    peer.start()
    figures: dict[str, list[tuple[float, float]]] = {kind: [] for kind in CLIENTS}
    try:
        one_round(peer, CLIENTS[0], 0, 1, 8)  # warm-up
        first = 1
        for r in range(args.rounds):
            for kind in CLIENTS if r % 2 == 0 else CLIENTS[::-1]:
                figures[kind].append(one_round(peer, kind, first, args.requests, args.max_tokens))
                first += args.requests
            print(f"round {r + 1}: " + ", ".join(f"{kind} ITL p50 {figures[kind][-1][0]:.2f} ms, client CPU "
                                                   f"{figures[kind][-1][1]:.3f} ms a chunk" for kind in CLIENTS), flush=True)
    finally:
        peer.stop()
    print(f"\n{args.dtype}, c = 1, {args.max_tokens}-token streams, {args.rounds} rounds of {args.requests} per client")
    for kind, rows in figures.items():
        print(f"{kind:8s} ITL p50 median {statistics.median(r[0] for r in rows):.2f} ms "
              f"(rounds {', '.join(f'{r[0]:.2f}' for r in rows)}), client CPU {statistics.median(r[1] for r in rows):.3f} ms a chunk")
    a, b = (statistics.median(r[0] for r in figures[k]) for k in CLIENTS)
    print(f"{CLIENTS[0]} ÷ {CLIENTS[1]} ITL: {a / b:.3f}")


if __name__ == "__main__":
    main()
