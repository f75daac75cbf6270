"""A request as the engine tracks it: tokens, progress, KV and timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is loading from a storage tier
    FINISHED = "finished"


@dataclass
class Sequence:
    """Progress is ``num_computed_tokens``: tokens whose KV is in the pool. Tokens past it
    (the rest of the prompt, or the last sampled token) are computed by the next steps."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    adapter_id: str | None = None
    priority: int = 0
    # Shared-public tenancy: leading blocks hashed without the salt, shared by every tenant
    # (cache/hashing.py CacheNamespace); set from ProcessedPrompt.public_blocks.
    public_blocks: int = 0
    # Who sent it, for fair share between tenants (engine/fair_share.py); None: no tenancy.
    tenant: str | None = None
    last_step: int = -1  # the scheduler step that last advanced it (fair share: whose turn it is)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: None for the first prompt token, then one dict a token, as the
    # prompt's chunks are computed (engine/prompt_logprobs.py)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank there (1: the most likely)
    # A scored prompt admitted after a prefix whose hidden rows were kept (engine/scored_prefix.py):
    # those rows, scored by the runner at the step that admitted it
    prefix_hidden: torch.Tensor | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first admission (-1: not admitted yet)
    num_preemptions: int = 0
    first_token_time: float | None = None
    # vLLM's phases: queued until first scheduled, prefill until the first token, then decode;
    # the gaps between consecutive output tokens (inter-token latency).
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    output_text: str = ""
    # The incremental detokenizer's state (output_processor.py): (decode stream, ids fed, text).
    detokenizer: tuple | None = field(default=None, repr=False, compare=False)
    generator: torch.Generator | None = None  # seeded sampling; made on the logits' device
    # Segment reuse: spans still to blend (None: ordinary prefill), tokens served from the
    # segment store, and how many leading tokens are exact enough to index as a prefix.
    segments: tuple | None = None
    num_segment_tokens: int = 0
    cache_limit: int | None = None
    # Automatic segment reuse (segment_reuse="auto", blend/auto.py): whether the engine looked
    # for stored chunks (once, on the step that admits it), the chunks it found (to blend),
    # tokens reused from them, the drift estimate, whether the guard fell back and how many
    # reused tokens it had recomputed beyond the ratio to meet its bound.
    auto_checked: bool = False
    auto_spans: tuple | None = None
    num_auto_tokens: int = 0
    auto_drift: float | None = None
    auto_fallback: bool = False
    num_auto_repaired: int = 0
    # Storage tiers: how many tokens came from tiers on admission (the loads themselves are
    # the scheduler's tier connector's state, kvmosaic/kv/connector.py).
    num_tier_tokens: int = 0
    # Parallel sampling (``n > 1``): a forked sample names its parent request and its choice
    # index (the parent is index 0).
    parent_id: str | None = None
    index: int = 0
    # Structured output: the grammar matcher following this request's tokens (structured.py).
    grammar: object | None = None
    # Why its prompt tokens missed the cache, by reason (the caller's own namespace only;
    # cache/lens.py), set at its first admission; None when not counted.
    miss_reasons: dict | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:  # the first token's entry; a one-token prompt has no other
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reads_cache(self) -> bool:
        """Whether its prompt may start from cached KV (the pool, the tiers, segment reuse): not
        when it asks for prompt log-probabilities, which need every prompt position computed."""
        return self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_cacheable_tokens(self) -> int:
        """Computed tokens whose KV is exact, so the prefix cache may index them."""
        n = self.num_computed_tokens
        return n if self.cache_limit is None else min(n, self.cache_limit)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time
