"""Decode attention over a cold paged pool: the C kernel the decode step runs, per step of every layer.

A decode step attends each sequence's whole context in every layer; past the weights, that KV is
what a batch-16 step reads (~240 MB for 16 contexts of ~650 tokens in the shipped model, bfloat16).
This builds the engine's own pool (``kv/paged.py``: ``--pool-mb``, 1 GB by default as ``serve``'s
``--kv-cache-memory``) for the shipped model's shape, puts ``--batch`` sequences of ``--tokens``
tokens in blocks taken at random from it (as a long-running server's free list leaves them) or in
order (``--in-order``: a fresh server), and times the kernel (``paged_decode_attention`` through
ctypes, one call per layer) over all layers, rotating over 4 such placements so that no step finds
the previous one's KV in the caches. Prints, per round, the step's time, the KV bytes it read per
second and that as a share of the read bandwidth (``torch.sum`` over 512 MB, in between).

Run: ``python -m benchmarks.decode_attention`` from the repository root (``--batch 1,16``,
``--tokens``, ``--dtype``, ``--rounds``, ``--in-order``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.bench.model_size import model_size
from kvmosaic.bench.roofline import best_seconds
from kvmosaic.kv.paged import PagedKVCache, dtype_bytes
from kvmosaic.model import kernels

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """The pool's view of the shipped model (kv/paged.py's KVShape)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def placements(num_blocks: int, batch: int, tokens: int, in_order: bool, count: int,
               gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` slot tables [batch, tokens], each sequence in whole blocks, disjoint within a table."""
    per_seq = -(-tokens // BLOCK_SIZE)
    if count * batch * per_seq > num_blocks:
        raise SystemExit(f"the pool holds {num_blocks} blocks, {count * batch * per_seq} asked: a larger --pool-mb")
    order = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=gen)
    tables = []
    for i in range(count):
        ids = order[i * batch * per_seq:(i + 1) * batch * per_seq].view(batch, per_seq)
        slots = ids.repeat_interleave(BLOCK_SIZE, 1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE).repeat(per_seq)
        tables.append(slots[:, :tokens].contiguous())
    return tables


def attention_step(lib, pool: PagedKVCache, config: Shape, batch: int, tokens: int, in_order: bool,
                   gen: torch.Generator, threads: int):
    """A function running the kernel once per layer for ``batch`` sequences, each call on the next
    of 4 placements of them in the pool."""
    tables = placements(pool.num_blocks, batch, tokens, in_order, 4, gen)
    lens = torch.full((batch,), tokens, dtype=torch.int64)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    q = torch.randn(batch, heads, dim, generator=gen).to(pool.dtype).float()
    out, lse = torch.empty(batch, heads, dim), torch.empty(batch, heads)
    bf16, turn = int(pool.dtype == torch.bfloat16), [0]

    def step() -> None:
        turn[0] += 1
        slots = tables[turn[0] % len(tables)]
        for k, v in zip(pool.k, pool.v):
            rc = lib.paged_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), bf16, 1, slots.data_ptr(),
                                            lens.data_ptr(), batch, heads, kv_heads, dim, tokens, dim**-0.5,
                                            out.data_ptr(), lse.data_ptr(), threads)
            assert rc == 0, rc

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=650, help="context tokens per sequence")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--in-order", action="store_true", help="blocks in pool order (a fresh server) instead of at random")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = kernels.decode_step_library()
    if lib is None:
        raise SystemExit("the C kernels are not built here")
    dtype = getattr(torch, args.dtype)
    size = model_size(None)
    config = Shape(size.num_layers, size.num_heads, size.num_kv_heads, size.head_dim)
    per_block = config.kv_bytes_per_token(dtype_bytes(dtype)) * BLOCK_SIZE
    pool = PagedKVCache(config, args.pool_mb * 2**20 // per_block, BLOCK_SIZE, dtype)
    gen = torch.Generator().manual_seed(0)
    pool.buffer.normal_(generator=gen)
    threads = torch.get_num_threads()
    buffer = torch.ones(512 * 2**20 // 4)
    print(describe(), flush=True)
    placed = "in order" if args.in_order else "at random"
    print(f"{config.num_layers} layers, {config.num_kv_heads} KV heads x {config.head_dim}, {args.dtype} pool of "
          f"{pool.num_blocks} blocks ({args.pool_mb} MB), blocks {placed}, {threads} thread(s)")
    print("| batch | round | step ms (all layers) | KV GB/s | read bandwidth GB/s | share of it |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        step = attention_step(lib, pool, config, batch, args.tokens, args.in_order, gen, threads)
        nbytes = batch * args.tokens * config.kv_bytes_per_token(dtype_bytes(dtype))
        for r in range(args.rounds):
            seconds = best_seconds(step, args.repeats)
            read = buffer.numel() * 4 / best_seconds(buffer.sum, 5) / 1e9
            gbs = nbytes / seconds / 1e9
            print(f"| {batch} | {r + 1} | {seconds * 1e3:.2f} | {gbs:.1f} | {read:.1f} | {gbs / read:.0%} |", flush=True)

if __name__ == "__main__":
    main()
