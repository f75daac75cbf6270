"""The engine's own figures (issue 2), in one run on one machine:

1. time to first token for a request whose long prefix is cached, against the same request
   cold (``--prefix`` tokens of prefix, ``--suffix`` new tokens);
2. throughput with the cache on against off, on a workload where nothing can hit;
3. prefill and decode tokens/s at several batch sizes, beside transformers on the same
   GGUF weights and dtype.

Runs are interleaved (A B A B ...) and medians reported, so machine drift cancels in ratios.
Run: ``python -m benchmarks.core_figures`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import warnings

import torch

from kvmosaic.engine import LLM, SamplingParams
from kvmosaic.model.loader import shipped_model_path


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """Token ids from the ordinary part of the vocabulary (no special tokens)."""
    return [rng.randrange(100, 49000) for _ in range(n)]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ttft_warm_cold(llm: LLM, prefix_len: int, suffix_len: int, reps: int, rng: random.Random) -> dict:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cold, warm = [], []
    for _ in range(reps):
        prefix = random_prompt(rng, prefix_len)
        llm.reset_prefix_cache()
        out = llm.generate([prefix + random_prompt(rng, suffix_len)], one)[0]
        cold.append(out.metrics["ttft"])
        out = llm.generate([prefix + random_prompt(rng, suffix_len)], one)[0]
        assert out.num_cached_tokens == prefix_len, out.num_cached_tokens
        warm.append(out.metrics["ttft"])
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_s": c, "warm_s": w, "ratio": w / c, "floor": suffix_len / (prefix_len + suffix_len)}


def no_reuse_throughput(on: LLM, off: LLM, n: int, prompt_len: int, out_len: int, rounds: int,
                        rng: random.Random) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t_on, t_off = [], []
    for _ in range(rounds):
        prompts = [random_prompt(rng, prompt_len) for _ in range(n)]
        t_off.append(timed(lambda prompts=prompts: off.generate(prompts, params)))
        t_on.append(timed(lambda prompts=prompts: on.generate(prompts, params)))
    tokens = n * (prompt_len + out_len)
    on_s, off_s = statistics.median(t_on), statistics.median(t_off)
    return {"on_tok_s": tokens / on_s, "off_tok_s": tokens / off_s, "ratio": off_s / on_s}


class HFPeer:
    """transformers' Llama on the same GGUF file and dtype, as a plain user runs it."""

    def __init__(self, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        d, f = os.path.split(shipped_model_path())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)


def speeds(run, batch: int, prompt_len: int, decode_len: int, rng: random.Random) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): prefill is a 1-token generation; decode is what
    ``decode_len`` more tokens add."""
    t1 = timed(lambda: run([random_prompt(rng, prompt_len) for _ in range(batch)], 1))
    tn = timed(lambda: run([random_prompt(rng, prompt_len) for _ in range(batch)], 1 + decode_len))
    return batch * prompt_len / t1, batch * decode_len / max(tn - t1, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix, args.suffix, args.reps, args.batches = 64, 8, 1, "1,2"
        args.prompt_len, args.decode_len = 32, 4
    rng = random.Random(0)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}")
    on = LLM(dtype=args.dtype, prefix_cache="hash")
    off = LLM(dtype=args.dtype, prefix_cache="none")
    on.generate([random_prompt(rng, 64)], SamplingParams(max_tokens=2))  # warm up kernels

    r = ttft_warm_cold(on, args.prefix, args.suffix, args.reps, rng)
    print(f"\nTTFT, {args.prefix}-token cached prefix + {args.suffix} new tokens: "
          f"cold {r['cold_s'] * 1000:.0f} ms, warm {r['warm_s'] * 1000:.1f} ms, "
          f"warm/cold {r['ratio']:.3f} (target <= 0.05, floor ~{r['floor']:.3f})")

    n = 4 if args.quick else 16
    t = no_reuse_throughput(on, off, n, args.prompt_len, args.decode_len, args.reps, rng)
    print(f"\nno-reuse throughput ({n} prompts x {args.prompt_len} + {args.decode_len} tokens): "
          f"cache on {t['on_tok_s']:.0f} tok/s, off {t['off_tok_s']:.0f} tok/s, on/off {t['ratio']:.3f} "
          f"(target >= 0.97)")

    hf = None if args.no_hf else HFPeer(on.engine.config.torch_dtype)
    ours_run = lambda prompts, k: off.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))  # noqa: E731
    print(f"\nprompt {args.prompt_len} tokens, decode {args.decode_len} tokens")
    print("| batch | kvmosaic prefill tok/s | transformers prefill tok/s | kvmosaic decode tok/s | transformers decode tok/s |")
    print("|---|---|---|---|---|")
    decode_at = {}
    for b in [int(x) for x in args.batches.split(",")]:
        pk, dk = speeds(ours_run, b, args.prompt_len, args.decode_len, rng)
        ph, dh = speeds(hf.generate, b, args.prompt_len, args.decode_len, rng) if hf else (float("nan"),) * 2
        decode_at[b] = dk
        print(f"| {b} | {pk:.0f} | {ph:.0f} | {dk:.1f} | {dh:.1f} |")
    bs = sorted(decode_at)
    print(f"\ndecode speed-up, batch {bs[-1]} vs batch {bs[0]}: {decode_at[bs[-1]] / decode_at[bs[0]]:.1f}x (target >= 4)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
