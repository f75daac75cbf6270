"""Where the fused decode step's time goes, phase by phase, beside the machine's read bandwidth.

Builds the kernels with their phase timers (``KVMOSAIC_KERNEL_DEFINES=KVMOSAIC_PHASE_TIMERS``,
decode_step.c: thread 0's seconds in each phase of every layer, the closing barrier included),
then for each of ``--requests`` single sequences of ``--tokens`` prompt tokens: the read
bandwidth (``roofline.read_bandwidth``: ``torch.sum`` over 512 MB, as ``kvmosaic bench roofline``), then ``--steps`` decode
steps at batch 1 through the engine. Prints per request and phase the milliseconds a step, the
bytes the phase reads (the weights; for attention the context's K and V) and the rate, as a share
of the bandwidth read just before; and the step's wall time beside the C phases' sum (the rest is
Python: scheduling, the step's inputs, sampling, the outputs).

Run: ``python -m benchmarks.decode_phases`` from the repository root (``--dtype``, ``--tokens``,
``--steps``, ``--requests``, ``--threads``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time

PHASES = ("norm + qkv", "attention", "merge + o", "norm + gate_up", "down", "final norm + head")


# Bytes a weight of a GGUF's Q4_1 projection takes in the kernels' split (kernels.Q4_1Weights): half a byte of
# nibbles, and per 32 weights a float32 scale and minimum
Q4_1_WEIGHT_BYTES = 0.5 + 8 / 32


def phase_bytes(cfg, vocab: int, element: int, context: float, weight_bytes: float | None = None) -> list[float]:
    """Bytes each phase reads in one step at batch 1 (its weights, ``weight_bytes`` each, ``element`` where
    None; attention: K and V, ``element`` each; the head: ``element`` a weight)."""
    layers, hidden, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weight = element if weight_bytes is None else weight_bytes
    per_layer = [hidden * (q_width + 2 * kv_width) * weight, 2 * context * kv_width * element,
                 q_width * hidden * weight, 2 * inter * hidden * weight, inter * hidden * weight]
    return [layers * n for n in per_layer] + [vocab * hidden * element]


def phase_cell(seconds: float, nbytes: float, read: float) -> str:
    """One phase's milliseconds a step and its read rate; "–" where the C step did not run it
    (where oneDNN's GEMMs run on AMX the LM head is oneDNN's, outside the C step)."""
    if seconds == 0.0:
        return "–"
    return f"{1e3 * seconds:.3f} ({nbytes / seconds / 1e9:.0f} GB/s, {nbytes / seconds / 1e9 / read:.0%})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=700, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per sequence")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", choices=("gguf",), default=None,
                    help="gguf: the projections on the file's Q4_1 blocks (the head stays in the dtype)")
    args = ap.parse_args()
    # before the first build; other defines given (a study's) stay
    os.environ["KVMOSAIC_KERNEL_DEFINES"] = " ".join(["KVMOSAIC_PHASE_TIMERS", os.environ.get("KVMOSAIC_KERNEL_DEFINES", "")]).strip()

    import torch

    from kvmosaic.bench.machine import describe
    from kvmosaic.bench.roofline import read_bandwidth
    from kvmosaic.engine.llm import LLM
    from kvmosaic.engine.sampling_params import SamplingParams
    from kvmosaic.model import kernels

    print(describe(), flush=True)
    llm = LLM(dtype=args.dtype, num_threads=args.threads, quantization=args.quantization)
    engine, model = llm.engine, llm.engine.model
    lib = kernels.decode_step_library()
    if lib is None or not hasattr(lib, "decode_phase_seconds"):
        raise SystemExit("no kernel library with phase timers here (a C compiler and AVX2 or AVX-512 are needed)")
    timers = (ctypes.c_double * len(PHASES)).in_dll(lib, "decode_phase_seconds")
    element = torch.finfo(getattr(torch, args.dtype)).bits // 8
    vocab = model.output_weight.shape[0]
    rng = random.Random(0)
    weights = "" if args.quantization is None else ", projections on Q4_1 blocks"
    print(f"\n{args.dtype}{weights}, {args.threads} threads, batch 1, {args.tokens}-token prompts, {args.steps} steps each\n")
    print("| request | read GB/s | step ms (wall) | C phases ms | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    for r in range(args.requests):
        read = read_bandwidth(args.threads)
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(args.tokens)]
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=args.steps + 2, temperature=0.0,
                                                                     ignore_eos=True), request_id=f"phases-{r}")
        engine.step(), engine.step()  # the prefill and a first decode step, untimed
        for i in range(len(PHASES)):
            timers[i] = 0.0
        walls = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        steps = len(walls)
        per_step = [timers[i] / steps for i in range(len(PHASES))]
        nbytes = phase_bytes(model.config, vocab, element, args.tokens + 2 + steps / 2,
                             Q4_1_WEIGHT_BYTES if args.quantization else None)
        cells = [phase_cell(t, b, read) for t, b in zip(per_step, nbytes)]
        print(f"| {r + 1} | {read:.1f} | {1e3 * statistics.median(walls):.2f} | {1e3 * sum(per_step):.2f} | "
              + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
