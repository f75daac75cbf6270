"""The prefill attention kernel alone, on the shipped model's shape, against the GEMM peak.

A ~750-token bfloat16 prefill spends ~15% of its time in attention (docs/ARCHITECTURE.md, "Prefill
attention"), the largest part that is not a projection. This times ``kernels.prefill.prefill_attention``
(the C kernel the layers call) for one layer of ``--tokens`` new tokens over the pool in place, q a view
of a fused QKV output as the layer hands it over, and prints its useful GFLOP/s (causal QK^T and P.V,
4 x head_dim per query-key pair and query head) and their share of a square GEMM's in the same dtype
(oneDNN's packed linear: the roofline's measure), best of ``--repeats`` per round. To compare two
versions of the kernel, run it from a worktree of each, alternated.

Run: ``python -m benchmarks.prefill_attention`` from the repository root (``--tokens``, ``--dtype``,
``--rounds``).
"""

from __future__ import annotations

import argparse

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.bench.model_size import model_size
from kvmosaic.bench.roofline import best_seconds, gemm_gflops
from kvmosaic.model.kernels import prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=745)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    dtype, n = getattr(torch, args.dtype), args.tokens
    size = model_size(None)
    heads, kv_heads, dim = size.num_heads, size.num_kv_heads, size.head_dim
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    pool_slots = 8 * n
    k, v = (torch.randn(pool_slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(pool_slots, generator=gen)[:n]
    if prefill.prefill_attention(q, k, v, slots, dim**-0.5) is None:
        raise SystemExit(f"no {args.dtype} prefill attention kernel on this CPU")
    flops = 4 * heads * dim * n * (n + 1) / 2
    print(describe(), flush=True)
    print(f"{n} tokens, {heads} heads ({kv_heads} KV) of {dim}, {args.dtype}, {torch.get_num_threads()} thread(s)")
    print("| round | ms a layer | GFLOP/s | square GEMM GFLOP/s | share of it |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        seconds = best_seconds(lambda: prefill.prefill_attention(q, k, v, slots, dim**-0.5), args.repeats)
        peak = gemm_gflops(args.dtype, [(2048, 2048, 2048)], 3)
        rate = flops / seconds / 1e9
        print(f"| {r + 1} | {seconds * 1e3:.2f} | {rate:.0f} | {peak:.0f} | {rate / peak:.0%} |", flush=True)


if __name__ == "__main__":
    main()
