"""The shadow audit of automatic reuse: on a sample of the requests answered from reused KV, the
drift the guard estimates is measured (issue 24; docs/ARCHITECTURE.md, "Automatic segment reuse").

The guard (``guard.py``) bounds an *estimate*, which ranks requests within a workload poorly
(BENCHMARKS.md, issue 24): it cannot promise that a request's answer stayed close to what a full
prefill gives. The audit measures that instead, on a share of the requests (``auto_reuse_audit_rate``).
The engine keeps the logits rows its first ``auto_reuse_audit_tokens`` answer tokens were drawn from
(:class:`AuditRecord`); once they are out, or the request ended (deferred with the chunk stores,
``engine_hook.py``), the prompt and those answer tokens are computed again in full in a scratch KV
buffer of its own (the prefix hit copied from the pool, exact; every later token recomputed, attending
only to exact KV) — a chunked prefill, one piece between two steps while other requests decode (at
most the prefill allowance beside decodes, engine/pace.py: :class:`AuditJob`) — and the audit's drift
is ``KL(full || reused)`` at each of those positions, averaged: with one token (the default) the
benchmark's ``KL first``, with 16 its teacher-forced ``KL mean`` (forced with the answer's own tokens).
The counters give operators the guard's real record live: how many audited answers drifted past the
bound, and the distribution of the drift.

Invariants: the audit reads the pool and writes only its scratch buffer (the request's KV, the
prefix cache and the segment store are unchanged); it never changes an answer; a request that the
guard sent back to a full prefill is not audited (nothing reused was kept); the blocks it reads stay
held (``KVCacheManager.hold``) from the blend until the audit began (:meth:`ShadowAudit.begin` copies
the prefix hit), even if the request ended before.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.lens import NO_TENANT, OTHER
from ..kv.paged import PagedKVCache
from ..model.llama import LlamaForCausalLM
from .forward import blend_forward

logger = logging.getLogger("kvmosaic.blend")
# Upper bounds of the drift histogram's buckets (KL in nats; +Inf is implied): about the bound's
# decade and two on either side, where the guard's estimate and the measured drift are compared.
KL_BUCKETS = (0.001, 0.003, 0.01, 0.02, 0.03, 0.05, 0.1, 0.3, 1.0)
MAX_TENANTS = 256
MAX_AUDIT_TOKENS = 64  # answer tokens an audit may cover: each keeps a float32 logits row [V] until it runs
# Audits collecting rows or under way at once (each holds its rows, then a scratch KV buffer of its prompt);
# an answer drawn while this many are open is not audited (``AuditStats.skipped``), so a backlog of audits
# behind busy steps never grows memory without bound.
MAX_IN_FLIGHT = 4


@dataclass
class AuditRecord:
    """An answer chosen for the audit, while its rows are collected: ``slots`` (the prompt's, held by
    ``held``) are exact below ``start``; ``rows``, the logits rows ``[V]`` its tokens were drawn from."""

    prompt_token_ids: list[int]
    slots: torch.Tensor
    start: int
    namespace: tuple
    tenant: str | None
    held: list
    preemptions: int  # the request's count when chosen: once preempted, its later rows are not from reuse
    rows: list[torch.Tensor] = field(default_factory=list)


@dataclass
class AuditStats:
    audits: int = 0  # answers from reused KV measured against a full prefill
    over_bound: int = 0  # of those, measured drift above the bound
    kl_sum: float = 0.0
    kl_counts: list[int] = field(default_factory=lambda: [0] * (len(KL_BUCKETS) + 1))  # per bucket, +Inf last
    failed: int = 0  # audits that raised (logged; the request was not affected)
    skipped: int = 0  # answers drawn for an audit while MAX_IN_FLIGHT were open: not audited
    seconds: float = 0.0  # spent auditing (on the engine's thread, between steps)
    tokens: int = 0  # answer tokens the audits covered (audits x auto_reuse_audit_tokens, less for short answers)
    buckets: tuple[float, ...] = KL_BUCKETS
    # per tenant label (the server's, from the API key; "-": none): [audits, over the bound], at most
    # MAX_TENANTS labels, later ones counted as "other" (as cache/lens.py counts them)
    tenants: dict[str, list[int]] = field(default_factory=dict)

    def add(self, kl: float, bound: float, seconds: float = 0.0, tenant: str | None = None, tokens: int = 1) -> None:
        self.audits += 1
        self.tokens += tokens
        self.seconds += seconds
        self.over_bound += kl > bound
        self.kl_sum += kl
        self.kl_counts[next((i for i, le in enumerate(self.buckets) if kl <= le), len(self.buckets))] += 1
        label = NO_TENANT if tenant is None else tenant
        if label not in self.tenants and len(self.tenants) >= MAX_TENANTS:
            label = OTHER
        fig = self.tenants.setdefault(label, [0, 0])
        fig[0] += 1
        fig[1] += kl > bound


def kl_to_full(full_logits: torch.Tensor, reused_logits: torch.Tensor) -> float:
    """``KL(full || reused)`` of the next-token distributions two logits rows ``[V]`` give, in nats,
    or the mean over rows of two ``[k, V]`` (computed in float64: the drift of interest is far above
    float32's rounding of a sum over V)."""
    full = torch.log_softmax(full_logits.double(), -1)
    reused = torch.log_softmax(reused_logits.double(), -1)
    per_row = (full.exp() * (full - reused)).sum(-1)
    return max(0.0, float(per_row.mean()))


@dataclass
class AuditJob:
    """An audit under way: the full prefill of ``token_ids`` (the prompt and the answer's tokens before
    its last row) computed into ``scratch`` a piece at a time; positions below ``done`` hold exact KV."""

    record: AuditRecord
    token_ids: list[int]
    scratch: PagedKVCache
    done: int
    seconds: float = 0.0


def scratch_with_prefix(kv: PagedKVCache, n: int, slots: torch.Tensor, start: int) -> PagedKVCache:
    """A KV buffer of its own for ``n`` positions (slot = position), the exact KV of positions below
    ``start`` (a prefix hit, at ``slots`` in ``kv``) copied into it. ``kv`` is only read."""
    bs = kv.block_size
    scratch = PagedKVCache(kv.config, -(-n // bs), bs, kv.dtype, kv.device)
    if start:
        src = slots[:start].to(kv.device)
        for layer in range(len(kv.k)):
            scratch.k[layer][:start] = kv.k[layer].index_select(0, src)
            scratch.v[layer][:start] = kv.v[layer].index_select(0, src)
    return scratch


@torch.inference_mode()
def prefill_piece(model: LlamaForCausalLM, job: AuditJob, budget: int | None) -> torch.Tensor | None:
    """The job's next positions, at most ``budget`` (None: all), computed behind the exact KV below
    ``job.done`` — a chunked prefill. Returns the last ``len(job.record.rows)`` positions' logits
    ``[k, V]`` once the end is reached, else None. A piece short of the end stops before those
    positions, so that the last piece computes them all (it may exceed the budget by them: k <= 64)."""
    n, k = len(job.token_ids), len(job.record.rows)
    end = n if budget is None or job.done + budget >= n else min(job.done + budget, n - k)
    if end <= job.done:
        end = n
    read = torch.arange(n - k, n) if end == n else torch.tensor([end - 1])
    out = blend_forward(model, job.scratch, torch.tensor(job.token_ids[:end], dtype=torch.long), torch.arange(end),
                        job.done, torch.zeros(end, dtype=torch.bool), read, None)
    job.done = end
    return out.logits if end == n else None


class ShadowAudit:
    """Which requests to audit (a seeded draw), the audits under way, and what the audits found."""

    def __init__(self, seed: int = 0) -> None:
        self._draw = random.Random(seed)
        self.stats = AuditStats()
        self.jobs: deque[AuditJob] = deque()

    def sampled(self, rate: float) -> bool:
        """Whether to audit the next answer, at ``rate`` (0: never, 1: always; no draw at either)."""
        return rate >= 1 or (rate > 0 and self._draw.random() < rate)

    def begin(self, kv: PagedKVCache, record: AuditRecord, answer: list[int]) -> None:
        """Start auditing an answer: ``record``, its rows (at least one); ``answer``, its tokens (the first
        ``len(record.rows) - 1`` are computed with the prompt). The prefix hit is copied now: from here on
        the audit reads nothing of the pool, and the caller may let its blocks go."""
        t0 = time.perf_counter()
        ids = record.prompt_token_ids + answer[:len(record.rows) - 1]
        job = AuditJob(record, ids, scratch_with_prefix(kv, len(ids), record.slots, record.start), record.start)
        job.seconds = time.perf_counter() - t0
        self.jobs.append(job)

    def advance(self, model: LlamaForCausalLM, budget: int | None, bound: float) -> list[tuple[AuditJob, float]]:
        """The oldest audit's next piece, at most ``budget`` positions, or with ``budget`` None every
        audit to its end. Returns ``(audit, measured drift)`` of those this completed (counted, with
        ``bound``, in :attr:`stats`); an audit that raised is dropped, counted as failed and logged."""
        finished = []
        while self.jobs:
            job = self.jobs[0]
            t0 = time.perf_counter()
            try:
                full = prefill_piece(model, job, budget)
            except Exception:  # noqa: BLE001 - an audit observes; it must not fail a step
                self.jobs.popleft()
                self.stats.failed += 1
                logger.exception("auditing an answer from reused KV failed")
                if budget is None:
                    continue
                break
            job.seconds += time.perf_counter() - t0
            if full is not None:
                self.jobs.popleft()
                kl = kl_to_full(full, torch.stack(job.record.rows).to(full.device))
                self.stats.add(kl, bound, job.seconds, job.record.tenant, tokens=len(job.record.rows))
                finished.append((job, kl))
            if budget is not None:
                break
        return finished
