"""Two builds of the kernel library in one process, alternated: which one is faster on this machine, now.

The VMs this project is measured on switch between memory modes from one minute to the next (a ~50 and
a ~80 GB/s read), and clocks drift: two processes run one after the other compare two minutes as much as
two kernels. This builds the C kernels twice, each from the working tree's sources or a git revision's
(``--a-rev``, ``--b-rev``) with extra ``-D`` defines of its own (``--a-defines``, ``--b-defines``),
loads both into one engine and alternates them: every ``--block`` decode steps of ``--batch`` sequences
(``--what decode``), or every ``--tokens``-token prefill (``--what prefill``), ``--rounds`` rounds, the
order flipped each round. It prints each round's medians and B's change against A, and over the run the
medians and the mean of the rounds' changes (rounds in a faster minute weigh as much as the others).

Both builds run the same engine, weights and pool; a build whose kernels sum in another order gives
outputs of its own (the figures compare time only). The library's agreement check against torch
(``kernels._agrees_with_torch``) is not run on these builds: check a change with the tests.

Run: ``python -m benchmarks.kernel_ab --b-defines TILE_AHEAD_HINT=_MM_HINT_T0`` (decode at batch 1),
``python -m benchmarks.kernel_ab --a-rev HEAD~1 --what prefill`` (from the repository root).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvmosaic.bench.machine import describe
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.model import kernels
from kvmosaic.model.kernels import prefill, rows

ROOT = Path(__file__).resolve().parent.parent


def sources_at(rev: str | None, into: Path) -> list[Path]:
    """The kernel sources (headers beside them) of the working tree, or of git revision ``rev`` written
    into ``into``; returns the .c files to compile."""
    if rev is None:
        return list(kernels.SOURCES)
    for path in kernels.SOURCES + kernels.HEADERS:
        rel = path.resolve().relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True).stdout
        (into / path.name).write_bytes(text)
    return [into / path.name for path in kernels.SOURCES]


def build(rev: str | None, defines: str, out: Path) -> ctypes.CDLL:
    """The library from ``rev``'s sources (None: the working tree's) with ``defines``, loaded and declared."""
    cc = kernels.compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        kernels.compile_library(cc, sources_at(rev, Path(tmp)), defines.split(), out)
    return kernels._declared(ctypes.CDLL(str(out)))


def use(lib: ctypes.CDLL) -> None:
    """Every caller of the kernel library reaches ``lib`` from now on."""
    for module in (kernels, rows, prefill):
        module._library = lambda lib=lib: lib


def decode_round(engine, libs: dict, order: tuple, batch: int, block: int, blocks: int, rng: random.Random,
                 round_no: int) -> dict[str, list[float]]:
    """``batch`` fresh sequences of 700 prompt tokens, then ``blocks`` blocks of ``block`` steps per build."""
    for b in range(batch):
        ids = [rng.randrange(1000, 40000) for _ in range(700)]
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=block * blocks * 2 + 4, temperature=0.0,
                                                                     ignore_eos=True), request_id=f"ab-{round_no}-{b}")
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in [*engine.scheduler.running, *engine.scheduler.waiting]):
        engine.step()
    engine.step()
    walls: dict[str, list[float]] = {name: [] for name in libs}
    for name in order * blocks:
        use(libs[name])
        for _ in range(block):
            start = time.perf_counter()
            engine.step()
            walls[name].append(time.perf_counter() - start)
    for rid in [f"ab-{round_no}-{b}" for b in range(batch)]:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return walls


def prefill_round(llm: LLM, libs: dict, order: tuple, tokens: int, repeats: int, rng: random.Random) -> dict[str, list[float]]:
    """``repeats`` prefills of ``tokens`` fresh tokens per build (one output token each)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    walls: dict[str, list[float]] = {name: [] for name in libs}
    for name in order * repeats:
        use(libs[name])
        ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params)
        walls[name].append(time.perf_counter() - start)
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a-rev", default=None, help="git revision of build A's kernel sources (default: the working tree)")
    ap.add_argument("--b-rev", default=None, help="the same for build B")
    ap.add_argument("--a-defines", default="", help="extra -D names for build A (space-separated)")
    ap.add_argument("--b-defines", default="", help="extra -D names for build B")
    ap.add_argument("--what", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="decode: sequences in each step")
    ap.add_argument("--block", type=int, default=20, help="decode: steps per build before switching")
    ap.add_argument("--tokens", type=int, default=745, help="prefill: new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(describe(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build(args.a_rev, args.a_defines, Path(tmp) / "a.so"),
                "B": build(args.b_rev, args.b_defines, Path(tmp) / "b.so")}
        use(libs["A"])
        llm = LLM(dtype=args.dtype, num_threads=args.threads)
        label = {"A": f"A ({args.a_rev or 'working tree'} {args.a_defines})".replace(" )", ")"),
                 "B": f"B ({args.b_rev or 'working tree'} {args.b_defines})".replace(" )", ")")}
        what = f"decode steps at batch {args.batch}" if args.what == "decode" else f"{args.tokens}-token prefills"
        print(f"{args.dtype}, {args.threads} threads, {what}; {label['A']} vs {label['B']}\n")
        print("| round | A ms (median) | B ms (median) | B vs A |\n|---|---|---|---|")
        rng = random.Random(0)
        every: dict[str, list[float]] = {"A": [], "B": []}
        changes = []
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            if args.what == "decode":
                walls = decode_round(llm.engine, libs, order, args.batch, args.block, 5, rng, r)
            else:
                walls = prefill_round(llm, libs, order, args.tokens, 2, rng)
            a, b = (statistics.median(walls[k]) for k in ("A", "B"))
            every["A"] += walls["A"]
            every["B"] += walls["B"]
            changes.append(b / a - 1)
            print(f"| {r + 1} | {a * 1e3:.2f} | {b * 1e3:.2f} | {100 * (b / a - 1):+.1f}% |", flush=True)
        a, b = (statistics.median(every[k]) for k in ("A", "B"))
        faster = sum(c < 0 for c in changes)
        print(f"| all | {a * 1e3:.3f} | {b * 1e3:.3f} | {100 * statistics.mean(changes):+.1f}% (mean of the rounds'; "
              f"B faster in {faster} of {len(changes)}) |")


if __name__ == "__main__":
    main()
