"""``kvmosaic serve | demo | generate | bench | explain``.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up (imports stay lazy so ``--help`` is fast).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "demo": ("kvmosaic.demo", "requests sharing a long system prompt: answers, cached tokens, TTFT"),
    "generate": ("kvmosaic.demo", "generate from one prompt"),
    "serve": ("kvmosaic.serve.cli", "OpenAI-compatible HTTP server (--replicas N: on Ray Serve)"),
    "bench": ("kvmosaic.bench.cli", "benchmarks against peers, with plots"),
    "explain": ("kvmosaic.explain", "where and why two prompts (or a prompt and a cache) diverge"),
    "audit": ("kvmosaic.audit", "probe a live server for cross-tenant cache leaks (TTFT AUC, KS, cached_tokens)"),
}


# Iterations an OpenMP worker spins at a barrier before it sleeps, for a server (libgomp's default:
# 300,000). A server shares its cores: beside a process busy 0.3 s of every second, each barrier of a
# decode step waited for a spinner descheduled on the taken core, and a stream's chunks for up to the
# whole burst (ITL p99 188-192 -> 73-77 ms, max 294-322 -> 81-90 ms with this value; quiet p50 13.6 /
# 13.7 ms: benchmarks/bursty_neighbour.py, BENCHMARKS.md). libgomp reads it when torch loads it, so it
# is set before anything imports torch; an operator's own value is kept.
SERVE_GOMP_SPINCOUNT = "10000"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve" and "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", SERVE_GOMP_SPINCOUNT)
    parser = argparse.ArgumentParser(prog="kvmosaic", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    name = argv[0] if argv and argv[0] in COMMANDS else None
    for cmd, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(cmd, help=help_text)
        if cmd == name:
            mod = importlib.import_module(module)
            (getattr(mod, f"add_{cmd}_arguments", None) or mod.add_arguments)(p)
    args = parser.parse_args(argv)
    mod = importlib.import_module(COMMANDS[args.command][0])
    return int((getattr(mod, f"run_{args.command}", None) or mod.run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
