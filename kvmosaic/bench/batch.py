"""``kvmosaic bench batch-16``: the offline "shared-system-prompt batch of 16" benchmark.

16 chat prompts sharing one long system prompt (the shared-system-prompt workload's, 750 words),
submitted together: kvmosaic's ``LLM.generate`` path (all 16 added, then stepped to the end) and
transformers' continuous batching (``generate_batch``, block sharing on), each in its own worker
process; and, as the yardstick issue 15 asks for, kvmosaic running the same 16 one at a time.
Every run starts with an empty cache (warm-up request first, then reset). Reported: wall time,
time per request, cached prompt tokens, and for kvmosaic the engine's steps (how many, tokens per
step, the slowest), so a batch slower than the same requests one at a time shows where.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ..server.tokenizer import tokenizer_for
from . import text
from .machine import describe
from .peers import PeerSettings, unavailable_reason
from .worker import PeerProcess

BATCH_PEERS = ("kvmosaic-hash", "transformers-cb")


def batch_prompts(tokenizer, n: int, system_words: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{seed}:batch")
    system = text.system_prompt(rng, system_words)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text.question(rng)}]
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


def step_summary(steps: list[dict] | None) -> dict | None:
    if not steps:
        return None
    timed = [s for s in steps if "s" in s]
    prefill = [s for s in timed if s["prefill_seqs"]]
    decode = [s for s in timed if not s["prefill_seqs"]]
    slow = max(timed, key=lambda s: s["s"]) if timed else None
    return {
        "steps": len(steps), "tokens": sum(s["tokens"] for s in steps),
        "prefill_steps": len(prefill), "prefill_s": sum(s["s"] for s in prefill),
        "prefill_tokens": sum(s["tokens"] for s in prefill),
        "decode_steps": len(decode), "decode_s": sum(s["s"] for s in decode),
        "decode_tokens_per_step": (sum(s["tokens"] for s in decode) / len(decode)) if decode else 0,
        "slowest_step": slow,
    }


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = 4 if args.quick else 16
    words, max_tokens = (60, 4) if args.quick else (750, args.max_tokens or 32)
    tokenizer = tokenizer_for(args.model)
    prompts = batch_prompts(tokenizer, n, words, args.seed)
    names = [p.strip() for p in (args.peers if args.peers_given else ",".join(BATCH_PEERS)).split(",") if p.strip()]
    skipped, results = [], []
    settings = PeerSettings(dtype=args.dtype, threads=args.threads, model_path=args.model)
    started = time.time()
    for name in names:
        reason = unavailable_reason(name)
        if reason:
            skipped.append(reason)
            continue
        proc = PeerProcess(name, settings)
        try:
            proc.wait_ready()
            warm = tokenizer.encode("Warm-up: say hello.", add_special_tokens=False)
            proc.generate(warm, 2)
            modes = ["batch", "sequential"] if name.startswith("kvmosaic") else ["batch"]
            for mode in modes:
                proc.reset()
                t0 = time.perf_counter()
                if mode == "batch":
                    gens, steps = proc.generate_many(prompts, max_tokens)
                else:
                    gens, steps = [proc.generate(p, max_tokens) for p in prompts], None
                wall = time.perf_counter() - t0
                results.append({"peer": name, "mode": mode, "wall_s": wall, "requests": len(gens),
                                "prompt_tokens": sum(len(p) for p in prompts),
                                "generated_tokens": sum(len(g.token_ids) for g in gens),
                                "cached_tokens": sum(g.cached_tokens for g in gens),
                                "ttft_max_s": max(g.ttft for g in gens), "steps": step_summary(steps)})
                print(f"{name} {mode}: {wall:.1f} s, cached {results[-1]['cached_tokens']}", flush=True)
        except RuntimeError as err:
            skipped.append(f"{name} failed: {str(err).strip().splitlines()[-1]}")
            print(skipped[-1])
        finally:
            proc.stop()
    ref = next((r for r in results if r["peer"] == "kvmosaic-hash" and r["mode"] == "batch"), None)
    lines = ["| engine | submitted | wall s | prompt tok | cached tok | gen tok | last first-token s | kvmosaic batch x faster |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['wall_s'] / ref['wall_s']:.2f}x" if ref else "–"
        lines.append(f"| {r['peer']} | {'all together' if r['mode'] == 'batch' else 'one at a time'} | {r['wall_s']:.1f} | "
                     f"{r['prompt_tokens']} | {r['cached_tokens']} | {r['generated_tokens']} | {r['ttft_max_s']:.1f} | {ratio} |")
    steps_md = []
    for r in results:
        s = r["steps"]
        if s:
            steps_md.append(f"- {r['peer']} {r['mode']}: {s['steps']} engine steps; {s['prefill_steps']} with prefill "
                            f"({s['prefill_tokens']} tokens, {s['prefill_s']:.1f} s), {s['decode_steps']} decode-only "
                            f"({s['decode_tokens_per_step']:.1f} tokens/step, {s['decode_s']:.1f} s); slowest step "
                            f"{s['slowest_step']}")
    header = [f"- command: `kvmosaic bench batch-16 --dtype {args.dtype}{' --quick' if args.quick else ''}`",
              f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}",
              f"- machine: {describe()}",
              f"- {n} chat prompts sharing a {words}-word system prompt, {max_tokens} output tokens each, greedy",
              f"- wall time: {time.time() - started:.0f} s (loads included)"]
    md = "\n".join(["# kvmosaic bench batch-16", "", *header, *[f"- skipped: {s}" for s in skipped], "", *lines, "",
                    *steps_md, ""])
    (out / "batch.md").write_text(md)
    (out / "batch.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=1))
    print(md)
    return 0 if results else 1
