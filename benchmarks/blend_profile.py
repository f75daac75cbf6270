"""Where an automatic blend's time goes on a device, and what a prompt length seen for the first time costs.

The H200 run of the twenty-fourth session (BENCHMARKS.md, "CUDA: the engine on an H200") found automatic
reuse ~6x slower than no reuse there, and a full prefill ~80–90 ms slower at a prompt length the process had
not seen; there was no device time left to find out why. This prints, on any device:

1. **First prefill at a length against the next one**: each RAG prompt run twice in a row with auto off and
   the prefix cache emptied between them (the same length, the same shapes), TTFT medians;
2. **A blend, first and again**: each prompt in auto mode twice in a row (the second finds the same chunks,
   recomputes about as many rows), TTFT medians;
3. **A profile of the second blends** (``torch.profiler``): the operators by self time on the device (CUDA)
   or the host (CPU), so that host-side work, synchronisations and per-shape set-up show up by name.

``--sdpa`` runs everything with one of torch's attention backends alone (``flash``, ``efficient``, ``cudnn``,
``math``), to tell whether a per-shape cost is that backend's set-up.

Run: ``python -m benchmarks.blend_profile --device cuda [--sdpa flash]`` (defaults: the setting of BENCHMARKS.md's
issue 24 figures: bfloat16, documents seen in four contexts, check layer 1, ratio 0.0625).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kvmosaic.bench.machine import describe

from .auto_reuse import Harness, earlier_traffic, rag_requests

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def ttft_pairs(h: Harness, prompts: list[str], auto: bool) -> tuple[float, float]:
    """Median TTFT of each prompt's first run and of its run right after (same mode, prefix cache emptied)."""
    first, again = [], []
    for p in prompts:
        first.append(h.run(auto, p, None, 1).metrics["ttft"])
        again.append(h.run(auto, p, None, 1).metrics["ttft"])
    return statistics.median(first), statistics.median(again)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=8, help="RAG prompts (plain text form)")
    ap.add_argument("--seen", type=int, default=4)
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.0625)
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25, help="operators listed")
    ap.add_argument("--sdpa", choices=sorted(BACKENDS), default=None, help="one attention backend alone")
    args = ap.parse_args()
    print(describe(), "; SDPA backend:", args.sdpa or "torch's choice", flush=True)
    with sdpa_kernel([BACKENDS[args.sdpa]]) if args.sdpa else contextlib.nullcontext():
        run(args)


def run(args: argparse.Namespace) -> None:
    h = Harness(args.dtype, 0.03, args.device, blend_ratio=args.ratio, auto_reuse_contexts=args.contexts,
                blend_check_layer=args.check_layer)
    rng = random.Random(0)
    earlier_traffic(h, rng, False, args.seen)
    prompts = [r.prompt for r in rag_requests(args.requests, rng, h.tok, False)]
    full_first, full_again = ttft_pairs(h, prompts, auto=False)
    print(f"full prefill, TTFT p50: first run of each prompt {full_first * 1e3:.1f} ms, again {full_again * 1e3:.1f} ms")
    auto_first, auto_again = ttft_pairs(h, prompts, auto=True)
    print(f"automatic blend, TTFT p50: first {auto_first * 1e3:.1f} ms, again {auto_again * 1e3:.1f} ms")
    on_device = h.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    for p in prompts:
        h.run(True, p, None, 1)  # this prompt's shapes seen once more before the profile
    with profile(activities=activities) as prof:
        for p in prompts:
            h.run(True, p, None, 1)
    key = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    print(f"\n{len(prompts)} blends profiled, operators by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    if on_device:
        print("operators by self_cpu_time_total (the host's side of the same blends):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
