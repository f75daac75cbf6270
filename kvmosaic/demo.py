"""``kvmosaic demo``: a few requests sharing a long system prompt, on the shipped model.

Prints, per request, the answer, how many prompt tokens came from the cache and the time to
first token; the first request pays for the system prompt, the rest skip that prefill.
"""

from __future__ import annotations

import argparse

from .engine import LLM, SamplingParams

SYSTEM_PROMPT = (
    "You are Mosaic, the support assistant of a company that sells tiles, grout and tools for "
    "bathrooms and kitchens. Answer in one or two short sentences, politely and precisely. "
    "Policies you know by heart: orders ship within two working days; returns are accepted for "
    "thirty days if the tiles are unused and in their boxes; grout and adhesives cannot be "
    "returned once opened; delivery is free above two hundred euros; samples cost three euros "
    "each and are refunded on the first order; the showroom opens Monday to Saturday from nine "
    "to six. When you do not know something, say so and suggest calling the showroom. "
) * 3

QUESTIONS = [
    "Can I return a box of tiles I did not use?",
    "How long does shipping take?",
    "Is delivery free for an order of 250 euros?",
    "When is the showroom open?",
]


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or safetensors folder (default: shipped)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prefix-cache", default="hash", choices=["hash", "radix", "none"])
    p.add_argument("--max-tokens", type=int, default=48)


def run_demo(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, prefix_cache=args.prefix_cache)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"model {llm.engine.model_name}, {llm.engine.config.dtype}, prefix cache: {args.prefix_cache}, "
          f"KV {llm.engine.kv.bytes_per_token} bytes/token, {llm.engine.pool.num_blocks} blocks")
    for q in QUESTIONS:
        out = llm.chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], params)[0]
        print(f"\nQ: {q}\nA: {out.text.strip()}")
        print(f"   prompt {len(out.prompt_token_ids)} tokens, cached {out.num_cached_tokens}, "
              f"TTFT {out.metrics['ttft'] * 1000:.0f} ms")
    st = llm.get_stats()
    print(f"\nprefix cache: {st.prefix_cache_hits}/{st.prefix_cache_queries} tokens hit "
          f"({st.prefix_cache_hit_rate:.0%})")
    return 0


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_demo_arguments(p)
    p.add_argument("prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="apply the chat template")


def run_generate(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, prefix_cache=args.prefix_cache)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0
