"""oneDNN's GEMM against the tile unit's for a prompt span of each projection, by row count.

Where the fused decode step's projections are on the tile unit (an AMX CPU in bfloat16), a span of
prompt rows takes one of the two by a fixed rule on its row count and the projection's width
(``model/prompt_gemms.py``, docs/ARCHITECTURE.md "On the tile unit"). This loads the model, times both
products over every layer's projections (the weights streamed as a prefill streams them) at each
``--rows``, best of ``--repeats``, and prints the milliseconds per projection kind over all layers, the
ratio, what oneDNN's first pass at that row count took more (building its kernel for the count: a
server meets new counts all the time), and which of the two the engine takes for that span
(``prompt_gemms.TILE_ROWS``, ``WIDE_TILE_ROWS``, ``TILE_MAX_OUT``). The column "gate/up + SiLU" is what a
SiLU layer's MLP runs: oneDNN's product then ``kernels.silu_mul`` against the tile GEMM with SiLU . up in
its epilogue (``PackedLinear.silu_product``); "all" adds the narrow three and that one.

Run: ``python -m benchmarks.prompt_gemms`` from the repository root (``--rows``, ``--repeats``).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvmosaic.bench.machine import describe
from kvmosaic.engine.llm import LLM
from kvmosaic.model import kernels, prompt_gemms
from kvmosaic.model.packed_linear import PackedLinear

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PLAIN = (PackedLinear.onednn_product, PackedLinear.tile_product)
SILU = (lambda m, x: kernels.silu_mul(m.onednn_product(x)), PackedLinear.silu_product)
EVICT_BYTES = 1 << 30  # read before each pass: more than the last-level cache
COLUMNS = (*((kind, kind, PLAIN) for kind in KINDS), ("gate/up + SiLU", "gate_up_proj", SILU))


def _all_layers(modules: list[PackedLinear], product, x: torch.Tensor, repeats: int,
                evict: torch.Tensor) -> tuple[float, float]:
    """(best of ``repeats`` passes over the layers, what the first pass took more: oneDNN's kernel for a
    row count it had not met). Each pass after ``evict`` is read: a forward streams every layer's weights
    from memory, where passes over one kind alone would find its weights in a large last-level cache
    (the AMX Xeon's L3 reads 504 MB: its QKV weights, 33 MB, stayed there from pass to pass)."""
    times = []
    for _ in range(repeats + 1):
        evict.sum()
        start = time.perf_counter()
        for module in modules:
            product(module, x)
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    return best, times[0] - best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="100,200,300,400,512,649,745,900,1024,1500,2048")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = LLM(dtype="bfloat16", enable_prefix_caching=False).engine.runner.model
    kinds = {kind: [getattr(layer, kind) for layer in model.layers] for kind in KINDS}
    evict = torch.ones(EVICT_BYTES // 4)
    if not all(type(m) is PackedLinear and prompt_gemms.on_tiles(m) for ms in kinds.values() for m in ms):
        raise SystemExit("the fused step's projections are not on the tile unit here: oneDNN's product serves every span")
    print(describe(), flush=True)
    print(f"{len(model.layers)} layers, {torch.get_num_threads()} threads; ms over all layers, oneDNN / tile GEMM "
          "(ratio) [oneDNN's first pass at the count: ms more], * the tile GEMM's is the engine's")
    print("| rows | " + " | ".join(name for name, _, _ in COLUMNS) + " | all |")
    print("|---|" + "---|" * (len(COLUMNS) + 1))
    for rows in map(int, args.rows.split(",")):
        cells, totals = [], [0.0, 0.0]
        for name, kind, products in COLUMNS:
            modules = kinds[kind]
            x = torch.randn(rows, modules[0].in_features).bfloat16()
            (onednn, first), (tile, _) = (_all_layers(modules, p, x, args.repeats, evict) for p in products)
            chosen = products is SILU and modules[0].tile_rows is not None or (
                products is PLAIN and modules[0].on_tiles_at(rows))
            cells.append(f"{onednn * 1e3:.1f} / {tile * 1e3:.1f} ({tile / onednn:.2f}) [+{first * 1e3:.1f}]"
                         f"{' *' if chosen else ''}")
            if name != "gate_up_proj":
                totals[0] += onednn
                totals[1] += tile
        print(f"| {rows} | " + " | ".join(cells) + f" | {totals[0] * 1e3:.1f} / {totals[1] * 1e3:.1f} |", flush=True)

if __name__ == "__main__":
    main()
