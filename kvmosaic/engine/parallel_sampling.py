"""Parallel sampling (``n > 1``): one request, ``n`` samples, one prompt computed.

A request with ``n`` samples runs as its parent sequence (sample 0) until its prompt is
computed; then samples 1..n-1 are forked from it (:meth:`ParallelSampling.fork`): each child
shares the parent's full KV blocks and gets a copy of its partial one
(``Scheduler.fork``), and samples from the parent's logits row in that same step. A child
that finds no block or no slot becomes a new request, which hits the prefix cache.

Invariant: every child id of a registered request ends exactly once: forked (then it finishes
as any request does), or ended with its parent when the parent ends before the fork (an
*orphan* output, handed to the caller with the step's outputs), or dropped when aborted
before the fork. docs/ARCHITECTURE.md ("A request's life").
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .sequence import Sequence

if TYPE_CHECKING:
    from .output_processor import OutputProcessor, RequestOutput
    from .scheduler import Scheduler


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of the samples 1..n-1 that a request with ``n`` samples forks."""
    return [f"{request_id}-{j}" for j in range(1, n)]


def make_child(parent: Sequence, child_id: str) -> Sequence:
    """Sample ``index`` of ``parent`` (its id's suffix, see :func:`child_request_ids`); a seeded
    parent's sample ``j`` draws with seed ``seed + j``."""
    index = int(child_id.rsplit("-", 1)[1])
    p = parent.params
    params = replace(p, n=1, seed=None if p.seed is None else (p.seed + index) % 2**63)
    child = Sequence(child_id, parent.prompt, parent.prompt_token_ids, params, parent.cache_salt,
                     parent.adapter_id, parent.priority, public_blocks=parent.public_blocks, tenant=parent.tenant,
                     arrival_time=parent.arrival_time)
    child.parent_id, child.index = parent.request_id, index
    child.first_scheduled_time = parent.first_scheduled_time  # its queue time is its parent's
    child.prompt_logprobs, child.prompt_ranks = parent.prompt_logprobs, parent.prompt_ranks  # the same prompt
    return child


class ParallelSampling:
    """The samples not forked yet, by parent request id, and the outputs of samples whose
    parent ended before forking them."""

    def __init__(self, outputs: OutputProcessor) -> None:
        self.outputs = outputs
        self.unforked: dict[str, list[str]] = {}
        self.orphans: list[RequestOutput] = []

    def register(self, seq: Sequence) -> None:
        if seq.params.n > 1:
            self.unforked[seq.request_id] = child_request_ids(seq.request_id, seq.params.n)

    def waiting_to_fork(self, request_id: str) -> bool:
        return request_id in self.unforked

    def abort(self, request_id: str) -> None:
        """An aborted parent forks nothing; an aborted sample not forked yet never will be."""
        if self.unforked.pop(request_id, None) is None:
            for pending in self.unforked.values():
                if request_id in pending:
                    pending.remove(request_id)

    def fork(self, parent: Sequence, scheduler: Scheduler, requests: dict[str, Sequence]) -> list[Sequence]:
        """The parent's samples, forked now that its prompt is computed; returns the ones that
        hold its KV (they sample from its logits row in this step)."""
        forked = []
        for cid in self.unforked.pop(parent.request_id, ()):
            child = make_child(parent, cid)
            child.grammar = parent.grammar.deep_copy() if parent.grammar is not None else None
            requests[cid] = child
            if scheduler.fork(parent, child):
                forked.append(child)
            else:  # no block for its copy, or max_num_seqs reached: a new request (it hits the prefix cache)
                scheduler.add(child)
        return forked

    def end_with(self, parent: Sequence, error: str | None = None, reason: str | None = None) -> None:
        """A parent that ends before its fork ends its samples too, the same way."""
        for cid in self.unforked.pop(parent.request_id, ()):
            child = make_child(parent, cid)
            child.status, child.finish_reason, child.finish_time = parent.status, parent.finish_reason, parent.finish_time
            self.orphans.append(self.outputs.make_output(child, error=error, error_reason=reason))

    def take_orphans(self) -> list[RequestOutput]:
        orphans, self.orphans = self.orphans, []
        return orphans
