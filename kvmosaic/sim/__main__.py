"""``python -m kvmosaic.sim [--quick] [--sizes 8 64 256] [--out docs/router]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .report import POLICIES, run_grid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmosaic.sim", description=__doc__)
    p.add_argument("--quick", action="store_true", help="8 replicas, few requests (a minute)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--requests-per-replica", type=int, default=40)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--out", type=Path, default=Path("docs/router"))
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.requests_per_replica = [8], 15
    run_grid(a.sizes, a.requests_per_replica, a.out, a.policies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
