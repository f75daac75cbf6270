"""How long one engine step takes, fitted to kvmosaic's own measurements (BENCHMARKS.md,
2 cores, SmolLM2-135M bfloat16, 2026-11):

* cold prefill of 256 tokens at 1,070 tok/s (0.93 ms/token) and of 2,048 tokens in 2,706 ms
  (1.32 ms/token): per token ``PREFILL_MS + PREFILL_MS_PER_CTX * position`` fits both (attention
  grows with the context);
* decode: 34.6 tok/s at batch 1 (29 ms a step) and 234 tok/s at batch 16 (68 ms a step):
  ``STEP_MS + DECODE_MS * batch`` fits both;
* a 2,048-token cached prefix + 32 new tokens took 112 ms: the fitted model gives 25 + 57 = 82 ms
  (the rest is reading the cached KV, left out).

Invariant: ``step_ms`` is a pure function of the step's work; the simulator adds nothing else.
"""

from __future__ import annotations

STEP_MS = 25.0  # fixed cost of a step (Python dispatch, sampling)
DECODE_MS = 2.7  # per sequence decoded in the step
PREFILL_MS = 0.88  # per prefilled token ...
PREFILL_MS_PER_CTX = 0.00043  # ... plus this much per token of context before it
MAX_BATCHED_TOKENS = 2048  # the engine's default --max-num-batched-tokens
MAX_NUM_SEQS = 64  # the engine's default --max-num-seqs
KV_BYTES_PER_TOKEN = 23_040  # bfloat16 KV of SmolLM2-135M: 2 x 30 layers x 3 heads x 64 x 2 bytes
POOL_BYTES = 1 << 30  # the engine's default --kv-cache-memory 1G


def prefill_ms(start: int, n: int) -> float:
    """Prefill of tokens ``start .. start + n`` behind ``start`` tokens of context."""
    mid = start + n / 2
    return n * (PREFILL_MS + PREFILL_MS_PER_CTX * mid)


def step_ms(num_decode: int, prefill_chunks: list[tuple[int, int]]) -> float:
    return STEP_MS + DECODE_MS * num_decode + sum(prefill_ms(s, n) for s, n in prefill_chunks)


def request_work_ms(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
    """One request's share of replica time (for setting the arrival rate, not for the run)."""
    return prefill_ms(cached_tokens, prompt_tokens - cached_tokens) + output_tokens * (DECODE_MS + 1.5)


def pool_blocks(block_size: int) -> int:
    return POOL_BYTES // (KV_BYTES_PER_TOKEN * block_size)
