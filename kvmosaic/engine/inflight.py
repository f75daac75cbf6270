"""One computation per shared prefix in flight: a waiting sequence whose next uncached block is
being computed right now by another sequence (running, or admitted earlier in the same step) is
passed over until that block is committed, then hits it instead of computing it again — a burst
of requests sharing a system prompt computes it once. It waits only while the other sequence's
prefill goes on, so nobody starves (tests: test_scheduler_inflight.py)."""

from __future__ import annotations

from ..cache.manager import KVCacheManager, MatchResult
from .sequence import Sequence


def uncommitted_blocks(kv: KVCacheManager, seq: Sequence) -> list:
    """Chain hashes of the prompt's full blocks that ``seq`` has still to compute."""
    hashes = kv.hasher(seq).update(seq.prompt_token_ids)
    return hashes[seq.num_computed_tokens // kv.block_size :]


def inflight_blocks(kv: KVCacheManager, running: list[Sequence]) -> set:
    """The blocks the running prefills are computing."""
    return {h for s in running if s.num_computed_tokens < s.num_prompt_tokens for h in uncommitted_blocks(kv, s)}


def next_block_in_flight(kv: KVCacheManager, seq: Sequence, match: MatchResult, inflight: set) -> bool:
    """Whether the first block ``seq`` would compute past ``match`` is among ``inflight``."""
    i = match.num_tokens // kv.block_size
    if i >= (seq.num_tokens - 1) // kv.block_size:  # nothing more it could hit
        return False
    hashes = kv.hasher(seq).update(seq.all_token_ids)
    return i < len(hashes) and hashes[i] in inflight
