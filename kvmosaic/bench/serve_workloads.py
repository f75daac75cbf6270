"""Workloads of ``kvmosaic bench serve`` (see :mod:`.serving`): the chat requests of each load
level, the run's sizes, and a prompt's length in tokens.

Every (workload, load level) pair gets prompts of its own (a fresh system prompt per level), so a
level never hits blocks cached by an earlier level.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import text

SERVE_WORKLOADS = ("shared-prefix", "no-reuse")


@dataclass(frozen=True)
class ServeSizes:
    system_words: int  # shared-prefix system prompt (750 words ~ 800 tokens with the chat template)
    max_tokens: int
    requests: int  # per closed-loop level: max(requests, 2 x concurrency)
    concurrency: tuple[int, ...]


FULL = ServeSizes(system_words=600, max_tokens=32, requests=32, concurrency=(1, 4, 16, 32))
QUICK = ServeSizes(system_words=120, max_tokens=8, requests=4, concurrency=(1, 4))


def serve_requests(workload: str, n: int, sizes: ServeSizes, seed: int, level: str) -> list[list[dict]]:
    """``n`` chat message lists for ``workload`` at load level ``level`` (its own prompts)."""
    rng = random.Random(f"{seed}:serve:{workload}:{level}")
    if workload == "shared-prefix":
        system = f"[{level}] " + text.system_prompt(rng, sizes.system_words)
        return [[{"role": "system", "content": system}, {"role": "user", "content": text.question(rng)}]
                for _ in range(n)]
    if workload == "no-reuse":
        out = []
        for i in range(n):
            opener = f"{rng.choice(text.NAMES)} {rng.randint(1000, 9999)} {level} {i}:"
            out.append([{"role": "system", "content": f"{opener} {text.paragraph(rng, sizes.system_words)}"},
                        {"role": "user", "content": text.question(rng)}])
        return out
    raise ValueError(f"unknown serving workload {workload!r}; choose from {', '.join(SERVE_WORKLOADS)}")


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """The chat prompt's length in tokens (the server renders the same template)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(rendered, add_special_tokens=False))
