"""``kvmosaic serve | demo | generate | bench | explain``.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up (imports stay lazy so ``--help`` is fast).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("kvmosaic.demo", "requests sharing a long system prompt: answers, cached tokens, TTFT"),
    "generate": ("kvmosaic.demo", "generate from one prompt"),
    "serve": ("kvmosaic.serve.cli", "OpenAI-compatible HTTP server (--replicas N: on Ray Serve)"),
    "bench": ("kvmosaic.bench.cli", "benchmarks against peers, with plots"),
    "explain": ("kvmosaic.explain", "where and why two prompts (or a prompt and a cache) diverge"),
    "audit": ("kvmosaic.audit", "probe a live server for cross-tenant cache leaks (TTFT AUC, KS, cached_tokens)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
