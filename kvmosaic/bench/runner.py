"""Run workloads on every peer, interleaved request by request (A B C, then B C A, ...), so
machine drift over time falls on every peer alike and cancels in their ratios."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from ..cache.radix_tree import common_prefix_len
from .prompts import PromptBuilder
from .worker import PeerProcess
from .workloads import Workload

WARMUP_PROMPT = "Warm-up: say hello."


@dataclass
class RequestRecord:
    workload: str
    peer: str
    index: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int  # prompt tokens the peer did not prefill (as it reports them)
    reusable_tokens: int  # longest prefix shared with an earlier sequence of this peer
    ttft: float
    e2e: float


@dataclass
class WorkloadRun:
    workload: Workload
    records: list[RequestRecord]
    peak_mb: dict[str, float]


def warm_up(peers: dict[str, PeerProcess], tokenizer) -> None:
    """One short unmeasured request per peer (first-call costs), then clear its caches."""
    ids = tokenizer.encode(WARMUP_PROMPT, add_special_tokens=False)
    for peer in tqdm(peers.values(), desc="warm-up", leave=False):
        peer.generate(ids, 2)
        peer.reset()


def run_workload(workload: Workload, peers: dict[str, PeerProcess], tokenizer) -> WorkloadRun:
    names = list(peers)
    builders = {n: PromptBuilder(tokenizer) for n in names}
    history: dict[str, list[list[int]]] = {n: [] for n in names}
    for peer in peers.values():
        peer.reset()
    records = []
    total = len(workload.requests) * len(names)
    with tqdm(total=total, desc=workload.name, unit="req") as bar:
        for i, req in enumerate(workload.requests):
            for name in names[i % len(names):] + names[: i % len(names)]:
                ids = builders[name].prompt_ids(req)
                reusable = max((common_prefix_len(ids, s) for s in history[name]), default=0)
                gen = peers[name].generate(ids, req.max_tokens)
                builders[name].record_answer(req, gen.token_ids)
                history[name].append(ids + gen.token_ids[:-1])
                records.append(RequestRecord(workload.name, name, i, len(ids), len(gen.token_ids),
                                             gen.cached_tokens, min(reusable, len(ids) - 1),
                                             gen.ttft, gen.e2e))
                bar.update(1)
    return WorkloadRun(workload, records, {n: p.peak_mb() for n, p in peers.items()})
