"""The fused decode step's weight layout: rows against decode tiles, at one token.

A decode step at c=1 streams every projection's weights once (model/decode_tiles.py). This runs
the C product the step uses (``linear_rows``, one row of x) over random weights (``--dtype``) of the
shipped model's shapes — every layer's QKV, output, gate/up and down projections, then the LM
head — in both layouts, alternated, in one process, and ``torch.sum`` over a 512 MB buffer
between them (the roofline's read bandwidth). Prints the best of ``--repeats`` per round, the
GB/s of each layout and its share of the read bandwidth. The two layouts' products are checked
equal bit for bit first.

Run: ``python -m benchmarks.decode_layout`` from the repository root (``--dtype``, ``--threads``, ``--rounds``).
"""

from __future__ import annotations

import argparse

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.bench.model_size import model_size
from kvmosaic.bench.roofline import best_seconds
from kvmosaic.model import decode_tiles, kernels


def shapes() -> list[tuple[int, int]]:
    """(out, in) of every projection the step reads, then the LM head's (vocab from its size)."""
    s = model_size(None)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer = [(q + 2 * kv, s.hidden_size), (s.hidden_size, q), (2 * s.intermediate_size, s.hidden_size),
             (s.hidden_size, s.intermediate_size)]
    return layer * s.num_layers + [(s.lm_head_params // s.hidden_size, s.hidden_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    lib = kernels.decode_step_library()
    if decode_tiles.tile_shape(dtype) is None:
        raise SystemExit(f"no fused {args.dtype} decode step on this CPU (float32 needs AVX-512 or AVX2 with FMA, "
                         "bfloat16 AVX512-BF16)")
    print(describe(), flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(o, i, generator=gen).to(dtype) for o, i in shapes()]
    tiles = [decode_tiles.to_tiles(w) for w in rows]
    widest = max(max(w.shape) for w in rows)
    x = torch.randn(1, widest, generator=gen).to(dtype)
    y, y_tiles = torch.empty(1, widest, dtype=dtype), torch.empty(1, widest, dtype=dtype)
    nbytes = sum(w.numel() * w.element_size() for w in rows)

    def product(weights: list[torch.Tensor], tiled: int, out: torch.Tensor, check: list | None = None) -> None:
        for w in weights:
            rc = lib.linear_rows(w.data_ptr(), w.shape[1], w.shape[0], tiled, x.data_ptr(), 1, out.data_ptr(),
                                 int(dtype == torch.bfloat16), threads)
            assert rc == 0, rc
            if check is not None:
                check.append(out[0, : w.shape[0]].clone())

    got_rows, got_tiles = [], []
    product(rows, 0, y, got_rows)
    product(tiles, 1, y_tiles, got_tiles)
    assert all(torch.equal(a, b) for a, b in zip(got_rows, got_tiles)), "the layouts' products differ"
    buffer = torch.ones(512 * 2**20 // 4)
    print(f"{len(rows)} products, {nbytes / 1e6:,.0f} MB of {args.dtype} weights, {threads} thread(s); best of "
          f"{args.repeats} per round")
    print("| round | rows GB/s | tiles GB/s | tiles / rows | read bandwidth GB/s | rows, tiles: share of it |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        t_rows = best_seconds(lambda: product(rows, 0, y), args.repeats)
        t_tiles = best_seconds(lambda: product(tiles, 1, y_tiles), args.repeats)
        read = buffer.numel() * 4 / best_seconds(buffer.sum, args.repeats) / 1e9
        a, b = nbytes / t_rows / 1e9, nbytes / t_tiles / 1e9
        print(f"| {r + 1} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {read:.1f} | {a / read:.0%}, {b / read:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
