"""``kvmosaic bench roofline``: this machine's ceilings at the chosen ``--threads``, measured in
this process with torch — the GEMM peak per dtype (float32, bfloat16) and the memory bandwidth
— so that a benchmark can say how close an engine comes to them ("at X% of the machine").

- GEMM: a large square product and the model's own prefill shapes (one layer's QKV, output,
  gate/up and down projections for ``tokens`` rows), each the best of ``repeats`` timed runs
  after a warm-up, by the faster of ``torch.matmul`` and oneDNN's pre-packed linear; and where
  kvmosaic's own tile GEMM serves (bfloat16 on an AMX CPU: ``model/decode_tiles.py``), the model's
  shapes by it too, since it outruns oneDNN's there and a peak below what an engine reaches would
  flatter every share of it. A dtype's peak is the best of them.
- Memory: a read (``sum`` over a tensor far larger than any cache) and a copy, best of
  ``repeats``; GB/s counts bytes read (+ written, for the copy). The read is the decode floor's
  denominator: a decode step reads its weights.

Guarantees: the thread count is set for the measurement and restored after; nothing is cached
between calls; figures are the best observed (a busy machine lowers them, never raises them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Roofline:
    threads: int
    gemm_gflops: dict[str, float]  # dtype -> peak (the better of square and model shapes)
    gemm_square_gflops: dict[str, float]
    gemm_model_gflops: dict[str, float]  # empty when the model's shapes could not be read
    read_gbs: float
    copy_gbs: float
    square: int
    model_tokens: int
    buffer_mb: int
    gemm_tile_gflops: dict[str, float] = field(default_factory=dict)  # the model's shapes by kvmosaic's tile GEMM

    def lines(self) -> list[str]:
        def shapes(d: str) -> str:
            return f"{self.gemm_model_gflops[d]:,.0f}" if d in self.gemm_model_gflops else "– (not read)"

        def tile(d: str) -> str:
            return f", kvmosaic's tile GEMM at them {self.gemm_tile_gflops[d]:,.0f}" if d in self.gemm_tile_gflops else ""

        gemm = ", ".join(f"{d} {self.gemm_gflops[d]:,.0f} GFLOP/s (square {self.gemm_square_gflops[d]:,.0f}, "
                         f"model shapes {shapes(d)}{tile(d)})" for d in self.gemm_gflops)
        return [f"GEMM peak at {self.threads} thread(s): {gemm}",
                f"memory bandwidth: read {self.read_gbs:,.1f} GB/s, copy {self.copy_gbs:,.1f} GB/s "
                f"({self.buffer_mb} MB buffers)"]


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch pages, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def model_shapes(model: str | None) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections (fused QKV, output, fused gate/up, down), from
    the model's GGUF metadata or config.json."""
    from .model_size import model_size

    s = model_size(model)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return [(s.hidden_size, q + 2 * kv), (q, s.hidden_size), (s.hidden_size, 2 * s.intermediate_size),
            (s.intermediate_size, s.hidden_size)]


def gemm_gflops(dtype: str, shapes: list[tuple[int, int, int]], repeats: int) -> float:
    """GFLOP/s of the products (m, k, n) run back to back, best of ``repeats``, by the faster of
    ``torch.matmul`` and oneDNN's pre-packed linear where torch has it (what the engine's
    projections run: model/packed_linear.py; MKL's float32 GEMM takes a path without AVX-512 on
    AMD CPUs, at less than half of oneDNN's rate)."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    ops = [(torch.randn(m, k, generator=gen).to(dt), torch.randn(k, n, generator=gen).to(dt)) for m, k, n in shapes]
    flops = sum(2.0 * m * k * n for m, k, n in shapes)

    def run() -> None:
        for a, b in ops:
            torch.matmul(a, b)

    best = best_seconds(run, repeats)
    try:
        packed = [(a, torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)) for a, b in ops]

        def run_packed() -> None:
            for a, w in packed:
                torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")

        best = min(best, best_seconds(run_packed, repeats))
    except (AttributeError, RuntimeError):  # no oneDNN in this torch build
        pass
    return flops / best / 1e9


def tile_gemm_gflops(shapes: list[tuple[int, int, int]], repeats: int) -> float | None:
    """GFLOP/s of the products (m, k, n) in bfloat16 by kvmosaic's tile GEMM (``decode_tiles.amx_product``, the
    weights in its B tiles), best of ``repeats``; None where it does not serve this CPU."""
    import torch

    from ..model import decode_tiles

    if not decode_tiles.amx_blocks():
        return None
    gen = torch.Generator().manual_seed(0)
    ops = [(torch.randn(m, k, generator=gen).bfloat16(), decode_tiles.to_amx(torch.randn(n, k, generator=gen).bfloat16()))
           for m, k, n in shapes]

    def run() -> None:
        for a, w in ops:
            decode_tiles.amx_product(w, a)

    return sum(2.0 * m * k * n for m, k, n in shapes) / best_seconds(run, repeats) / 1e9


def read_gbs(buffer, repeats: int) -> float:
    """GB/s of ``buffer.sum()`` over a float32 tensor, best of ``repeats``."""
    return buffer.numel() * 4 / best_seconds(lambda: buffer.sum(), repeats) / 1e9


def bandwidth_gbs(buffer_mb: int, repeats: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over float32 buffers of ``buffer_mb`` MB."""
    import torch

    src = torch.ones(buffer_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = read_gbs(src, repeats)
    copy = 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9
    return read, copy


def _sizes(quick: bool) -> tuple[int, int, int, int]:
    """(square GEMM side, model-shape GEMM tokens, bandwidth buffer MB, repeats)."""
    return (512, 128, 128, 3) if quick else (2048, 512, 512, 5)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch at ``threads`` threads (None: all cores) inside, as before after."""
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_bandwidth(threads: int | None, quick: bool = False) -> float:
    """One read-bandwidth reading (GB/s) as :func:`measure` takes it, at ``threads`` torch threads."""
    _, _, buffer_mb, repeats = _sizes(quick)
    with _torch_threads(threads):
        return bandwidth_gbs(buffer_mb, repeats)[0]


class ReadProbe:
    """Read-bandwidth readings (GB/s) as :func:`read_bandwidth` takes them, over one buffer allocated and
    touched when the probe is made: a reading then allocates nothing. On the Zen 5 VM a fresh 1 GB
    allocation before each reading slowed the decode of the request sent right after it by ~25% (ITL
    7.2-8.1 against 5.8-6.1 ms), a kept buffer not at all; and the VM's bandwidth changes mode within
    seconds, so a reading is only worth its pairing when taken right before what it is paired with."""

    SETTLE_S = 1.0  # after the buffer's first touch, before any reading is used

    def __init__(self, threads: int | None, quick: bool = False) -> None:
        import torch

        _, _, buffer_mb, self.repeats = _sizes(quick)
        self.threads = threads
        with _torch_threads(threads):
            self.buffer = torch.ones(buffer_mb * 2**20 // 4)
        time.sleep(self.SETTLE_S)

    def read(self) -> float:
        with _torch_threads(self.threads):
            return read_gbs(self.buffer, self.repeats)


def measure(threads: int | None, model: str | None = None, quick: bool = False) -> Roofline:
    """The roofline at ``threads`` torch threads (None: all cores); the model-shape GEMMs are left
    out (and said so) when ``model``'s files cannot be read."""
    import torch

    square, tokens, buffer_mb, repeats = _sizes(quick)
    with _torch_threads(threads):
        try:
            layer = [(tokens, k, n) for k, n in model_shapes(model)]
        except (OSError, ValueError, KeyError):
            layer = []
        sq = {d: gemm_gflops(d, [(square, square, square)], repeats) for d in DTYPES}
        md = {d: gemm_gflops(d, layer, repeats) for d in DTYPES} if layer else {}
        tile = tile_gemm_gflops(layer, repeats) if layer else None
        tl = {} if tile is None else {"bfloat16": tile}
        read, copy = bandwidth_gbs(buffer_mb, repeats)
        used = torch.get_num_threads()
    peak = {d: max(sq[d], md.get(d, 0.0), tl.get(d, 0.0)) for d in DTYPES}
    return Roofline(used, peak, sq, md, read, copy, square, tokens, buffer_mb, tl)


def write(out: Path, roofline: Roofline, header: dict) -> Path:
    """Sets the ``roofline`` entry of ``out/bench.json`` (the file's other entries are kept)."""
    path = out / "bench.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["roofline"] = {**header, **asdict(roofline)}
    path.write_text(json.dumps(data, indent=1))
    return path


def run(args: argparse.Namespace) -> int:
    from .machine import describe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    roofline = measure(args.threads, args.model, args.quick)
    command = "kvmosaic bench roofline" + (f" --threads {args.threads}" if args.threads else "") + (" --quick" if args.quick else "")
    header = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": describe()}
    print(f"machine: {header['machine']}")
    for line in roofline.lines():
        print(line)
    print(f"wrote {write(out, roofline, header)}")
    return 0
