"""KV held by the hybrid layout (issue 22): ``python -m benchmarks.hybrid_kv``.

A Gemma-3-like model (transformers' Gemma3TextConfig, 6 layers: 5 sliding-window : 1 global,
window 512, hidden 64; fixed-seed random weights, built by transformers, nothing downloaded)
runs in kvmosaic with ``--kv-layout auto`` (hybrid) and ``full`` (every layer keeps the whole
context: the bytes of the same model with all layers global). Reported, per layout:

* ``held_decode``: bytes of KV pages a request holds at its first decode step, after a
  ``--prompt``-token prefill (default 4,096: eight windows) — ``LLMEngine.kv_bytes_held``;
* ``held_peak``: the most it held at any step (the last prefill chunk, before the window
  groups give the chunk's older blocks back);
* the shared-system-prompt workload (``--requests`` requests: one ``--system``-token prompt,
  distinct 64-token questions): prefix-cache hit rate (tokens hit / tokens queried);
* greedy tokens equal between the layouts (float32).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from kvmosaic import LLM, SamplingParams
from tests.tiny_models import build

WINDOW = 512


def gemma3_like(max_len: int) -> tuple[str, dict]:
    return ("Gemma3TextConfig", dict(
        num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
        max_position_embeddings=max_len, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}))


def measure(path: str, layout: str, args) -> dict:
    llm = LLM(model=path, dtype="float32", device="cpu", kv_layout=layout, block_size=args.block_size,
              num_kv_blocks=args.blocks, max_num_batched_tokens=args.chunk)
    engine = llm.engine
    held: dict[str, list[int]] = {}
    execute = engine.runner.execute

    def wrapped(batch):
        for s, _ in batch:
            held.setdefault(s.seq.request_id, []).append(engine.kv_bytes_held(s.seq.request_id))
        return execute(batch)

    engine.runner.execute = wrapped
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = [rng.randrange(256) for _ in range(args.prompt)]
    out = llm.generate([long], params)[0]
    steps = held[out.request_id]  # per step: the bytes held as the step ran (after allocation)
    system = [rng.randrange(256) for _ in range(args.system)]
    prompts = [system + [rng.randrange(256) for _ in range(64)] for _ in range(args.requests)]
    before = engine.get_stats()
    outs = llm.generate(prompts, params)
    after = engine.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert engine.cache.size_info().in_use == 0, "the pool is not idle after the workload"
    return {
        "layout": [(g.window, len(g.layers)) for g in engine.kv_layout.groups],
        "held_decode": steps[-len(out.token_ids) + 1], "held_peak": max(steps),
        "hit_rate": hits / queries, "tokens": [out.token_ids] + [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=1024, help="pool size in blocks of the full layout")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build("gemma3", Path(tmp), spec=gemma3_like(max(args.prompt, args.system) + 128))
        hybrid, full = measure(tmp, "auto", args), measure(tmp, "full", args)
    report = {
        "prompt": args.prompt, "window": WINDOW, "block_size": args.block_size, "groups (window, layers)": str(hybrid["layout"]),
        "held_decode_bytes": {"hybrid": hybrid["held_decode"], "full": full["held_decode"]},
        "held_decode_ratio": round(hybrid["held_decode"] / full["held_decode"], 4),
        "held_peak_ratio": round(hybrid["held_peak"] / full["held_peak"], 4),
        "hit_rate": {"hybrid": round(hybrid["hit_rate"], 4), "full": round(full["hit_rate"], 4)},
        "hit_rate_ratio": round(hybrid["hit_rate"] / full["hit_rate"], 4),
        "tokens_equal": hybrid["tokens"] == full["tokens"],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
