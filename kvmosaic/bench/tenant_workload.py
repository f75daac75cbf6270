"""The multi-tenant workload of ``kvmosaic bench scale`` and ``benchmarks/replicas.py``: tenants
with distinct system prompts (no block shared between two), a seeded order of their requests,
and a pool sized to hold a given number of tenants' prefixes, so that where a request is routed
decides whether its prefix is found.
"""

from __future__ import annotations

import math
import random

WORDS = ("invoice refund shipping warranty account billing order parcel voucher ledger policy "
         "escalate verify courteous concise summary customer region holiday discount premium").split()


def tenants(n: int, system_tokens: int, seed: int = 0) -> list[str]:
    """Distinct system prompts (different from their first words on, so no block is shared)."""
    rng = random.Random(seed)
    words = max(8, int(system_tokens / 1.25))
    return [f"Tenant {t} rules. " + " ".join(rng.choice(WORDS) for _ in range(words)) for t in range(n)]


def schedule(n_requests: int, n_tenants: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(n_tenants) for _ in range(n_requests)]


def pool_blocks(system_prompt_tokens: int, pool_tenants: float, block_size: int = 16) -> int:
    per_tenant = math.ceil((system_prompt_tokens + 32) / block_size)
    return math.ceil(pool_tenants * per_tenant) + 4


def measure_tokens(text: str) -> int:
    """Tokens of ``text`` in the shipped model's tokenizer (no special tokens)."""
    from ..server.tokenizer import tokenizer_for

    return len(tokenizer_for(None).encode(text, add_special_tokens=False))


def conversations(systems: list[str], order: list[int]) -> list[list[dict]]:
    """The chat requests of a schedule: request ``i`` is tenant ``order[i]``'s system prompt and a
    short question of its own."""
    return [[{"role": "system", "content": systems[t]},
             {"role": "user", "content": f"Question {i}: what is {i} + {t}?"}] for i, t in enumerate(order)]
