"""What weight-only quantization (int8, gguf) costs in quality and buys in speed: ``python -m kvmosaic.bench.quant``.

Each of ``--quantizations`` (default ``int8,gguf``: model/quant.py, model/quant_gguf.py) is
compared with the float model on the same weights (the default path, ``--dtype``).

Quality, on chat prompts of the benchmark's vocabulary (shared system prompt + a question):

* free-running greedy: the int8 model's continuation against the float model's (identical
  continuations, mean position of the first difference);
* teacher-forced on the float model's greedy continuation: top-1 agreement, the change in the
  log-probability of each float-greedy token, and the KL divergence float -> quantized per
  position, the quantized model's logits computed by the kernels decode runs (the GEMV
  thresholds raised for it: a long prefill would take the dequantized GEMM, which for gguf is
  the float model's own product).

Speed, in one process, the float and quantized engines taking turns: batch-1 decode step time
(the ITL at c=1 without a server), and the end-to-end time of a cache-hit request (the shared
system prompt cached, a new question, 32 tokens out). All engines use ``--dtype`` (float32 by
default) for activations and KV.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from pathlib import Path

import torch

from .text import question, system_prompt


def chat_prompts(tokenizer, n: int, seed: int, system_words: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    system = system_prompt(rng, system_words)
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": question(rng)}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False) for _ in range(n)]


def all_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits at every position, from one prefill through a scratch KV pool."""
    from kvmosaic.kv.paged import PagedKVCache
    from kvmosaic.model.attention import AttentionMetadata, PrefillSpan

    n, bs = len(token_ids), engine.config.block_size
    kv = PagedKVCache(engine.model_config, -(-n // bs), bs, engine.config.torch_dtype, engine.device)
    slots = torch.arange(n, device=engine.device)
    meta = AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)])
    ids = torch.tensor(token_ids, device=engine.device)
    return engine.model(ids, torch.arange(n, device=engine.device), kv, meta, None).float()


@contextlib.contextmanager
def decode_kernels():
    """Every row through the quantized layers' decode kernels (GEMV), however many rows."""
    from kvmosaic.model import quant, quant_gguf

    saved = quant.GEMV_MAX_ROWS, quant_gguf.GEMV_MAX_ROWS
    quant.GEMV_MAX_ROWS = quant_gguf.GEMV_MAX_ROWS = 1 << 30
    try:
        yield
    finally:
        quant.GEMV_MAX_ROWS, quant_gguf.GEMV_MAX_ROWS = saved


def quality(ref_llm, q_llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from kvmosaic import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    got = [o.token_ids for o in q_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    agree, dlogp, kl = [], [], []
    for prompt, cont in zip(prompts, ref):
        full = prompt + cont
        rows = slice(len(prompt) - 1, len(full) - 1)  # the positions that predicted `cont`
        lp_ref = torch.log_softmax(all_logits(ref_llm.engine, full)[rows], -1)
        with decode_kernels():
            lp_q = torch.log_softmax(all_logits(q_llm.engine, full)[rows], -1)
        target = torch.tensor(cont)
        agree += (lp_q.argmax(-1) == target).tolist()
        dlogp += (lp_q.gather(1, target[:, None]) - lp_ref.gather(1, target[:, None])).abs().squeeze(1).tolist()
        kl += (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).clamp(min=0).tolist()
    dlogp.sort()
    return {
        "prompts": len(prompts), "tokens": len(agree),
        "greedy_identical": sum(d == max_tokens for d in first_diff) / len(prompts),
        "greedy_first_difference_mean": statistics.fmean(first_diff),
        "teacher_forced_top1_agreement": sum(agree) / len(agree),
        "logprob_abs_change_mean": statistics.fmean(dlogp),
        "logprob_abs_change_p99": dlogp[int(0.99 * (len(dlogp) - 1))],
        "logprob_abs_change_max": dlogp[-1],
        "kl_mean": statistics.fmean(kl), "kl_max": max(kl),
    }


def decode_step_ms(llm, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode step: (a cache-hit request for ``tokens`` tokens - the same for one) /
    (tokens - 1); the prompt is cached by a first, untimed request."""
    from kvmosaic import SamplingParams

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    llm.engine.reset_prefix_cache()
    timed(1)
    return (timed(tokens) - timed(1)) / (tokens - 1) * 1e3


def hit_request_ms(llm, system_and_question: list[int], tokens: int) -> float:
    from kvmosaic import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": system_and_question}], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return (time.perf_counter() - t) * 1e3


def weight_bytes(model) -> int:
    """Bytes of the 2-D weights the model computes with (int8 / Q4_1 blocks included); a packed
    layer's kept plain copy is counted once."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if t.dtype in (torch.int8, torch.uint8, torch.float32, torch.bfloat16, torch.float16) and t.dim() == 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="chat prompts for the quality figures")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per engine (alternating)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantizations", default="int8,gguf", help="comma-separated, each against the float model")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="3 prompts, 16 tokens, 1 repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.reps = 3, 16, 1
    from kvmosaic import LLM

    common = {"dtype": args.dtype, "num_threads": args.threads}
    names = [q for q in args.quantizations.split(",") if q]
    llms = {"float": LLM(**common), **{q: LLM(quantization=q, **common) for q in names}}
    ref = llms["float"]
    prompts = chat_prompts(ref.tokenizer, args.prompts, args.seed)
    quals = {q: quality(ref, llms[q], prompts, args.max_tokens) for q in names}

    rng = random.Random(args.seed)
    decode: dict[str, list[float]] = {k: [] for k in llms}
    hit: dict[str, list[float]] = {k: [] for k in llms}
    hits = chat_prompts(ref.tokenizer, len(llms) * args.reps + 1, args.seed + 1)
    for llm in llms.values():  # cache the shared system prompt (and warm up)
        hit_request_ms(llm, hits[0], 4)
    for r in range(args.reps):
        prompt = [rng.randrange(100, 20000) for _ in range(256)]
        order = list(llms.items())
        order = order[r % len(order):] + order[: r % len(order)]  # each engine leads in turn
        for name, llm in order:
            decode[name].append(decode_step_ms(llm, prompt, args.max_tokens))
            hit_request_ms(llm, hits[0], 1)  # re-cache the system prompt after the reset
            hit[name].append(hit_request_ms(llm, hits[1 + len(llms) * r + list(llms).index(name)], 32))
    med = {k: statistics.median(v) for k, v in decode.items()}
    med_hit = {k: statistics.median(v) for k, v in hit.items()}
    result = {
        "dtype": args.dtype, "quality": quals,
        "decode_step_ms": med, "decode_speedup": {q: med["float"] / med[q] for q in names},
        "cache_hit_request_ms": med_hit, "cache_hit_speedup": {q: med_hit["float"] / med_hit[q] for q in names},
        "weight_bytes": {k: weight_bytes(llm.engine.model) for k, llm in llms.items()},
        "reps": args.reps, "raw": {"decode": decode, "hit": hit},
    }
    wb = result["weight_bytes"]
    for q, qual in quals.items():
        print(f"\nweight-only {q} vs {args.dtype} ({qual['prompts']} chat prompts, {args.max_tokens} greedy tokens each)")
        print("| measure | value |\n|---|---|")
        print(f"| greedy continuations identical | {qual['greedy_identical']:.0%} (first difference at token "
              f"{qual['greedy_first_difference_mean']:.1f} on average) |")
        print(f"| teacher-forced top-1 agreement | {qual['teacher_forced_top1_agreement']:.1%} of {qual['tokens']} tokens |")
        print(f"| abs. change in the float-greedy token's logprob | mean {qual['logprob_abs_change_mean']:.4f}, "
              f"p99 {qual['logprob_abs_change_p99']:.4f}, max {qual['logprob_abs_change_max']:.4f} |")
        print(f"| KL(float -> {q}) per token | mean {qual['kl_mean']:.5f}, max {qual['kl_max']:.4f} |")
        print(f"| batch-1 decode step, float / {q} (ms) | {med['float']:.1f} / {med[q]:.1f} = "
              f"**{result['decode_speedup'][q]:.2f}x** |")
        print(f"| cache-hit request (32 tokens out), float / {q} (ms) | {med_hit['float']:.0f} / {med_hit[q]:.0f} = "
              f"**{result['cache_hit_speedup'][q]:.2f}x** |")
        print(f"| weight bytes (2-D weights and blocks), float / {q} | {wb['float'] / 1e6:.0f} MB / {wb[q] / 1e6:.0f} MB |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
