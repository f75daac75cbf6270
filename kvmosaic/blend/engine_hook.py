"""The engine's side of segment reuse: which scheduled sequences get a blend forward, and
running it for them.

A sequence takes part when it was added with segments while a mode other than ``off`` was
set (``seq.segments`` holds its spans), on the step that admits it. Its whole prompt's blocks
are then allocated through the normal cache manager, one blend forward writes the final KV
of every prompt token, and the sequence decodes like any other from the next step on. If the
pool cannot supply the blocks, the sequence simply continues as an ordinary (exact) prefill.

Blended KV is approximate, so it must never be served as an exact prefix hit: the sequence's
``cache_limit`` stops the prefix cache from indexing anything from the first token that kept
moved KV on (everything before it, e.g. a head and segments seen for the first time, is exact).

With ``segment_reuse="auto"`` (blend/auto.py) an unmarked prompt is looked up by its chunks on
the step that admits it; one with enough found takes the blend path (then the guard), the rest
run as ordinary prefills, and every prompt's chunks are stored once its KV is complete
(:meth:`SegmentReuse.harvest`). With any other mode nothing here touches an unmarked prompt.

Storing is off the first token's path: the step that completes a prompt only takes one more
reference on its blocks (``KVCacheManager.hold``); the chunks are stored and folded by
:meth:`SegmentReuse.finish_pending`, which the engine runs at the start of its next step (or when
its caller stops stepping), after the step's outputs went out, and which then drops the references.
Until then the prompt's KV stays where it was written even if the request has finished; a failed
store costs the store those chunks, never the request. The shadow audit of a sampled answer from
reused KV (``shadow.py``, ``auto_reuse_audit_rate``) is deferred the same way, once the logits rows of
its first ``auto_reuse_audit_tokens`` answer tokens are kept (:meth:`SegmentReuse.observe`) or the
request ended; its blocks are held from the blend on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from ..cache.segments import segment_seed
from ..kv.paged import PagedKVCache
from ..model.llama import LlamaForCausalLM
from ..tiers import TierStack
from . import shadow
from .auto import AutoReuse, auto_floor, rule_for
from .blender import Blender, BlendOptions
from .breaker import TRIP_HOLD_S, DriftBreaker
from .shadow import AuditRecord, ShadowAudit
from .store import SegmentKVStore

logger = logging.getLogger("kvmosaic.blend")


class SegmentReuse:
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, config, model_fingerprint: str,
                 tiers: TierStack | None = None, tokenizer=None) -> None:
        """``tiers``: the engine's storage tiers, where stored segments also go (None: off);
        ``tokenizer``: its break tokens cut chunks for auto reuse (None: no auto reuse)."""
        if config.segment_reuse != "off" and not 1 <= config.blend_check_layer < model.config.num_layers:
            raise ValueError(f"blend_check_layer must be in [1, {model.config.num_layers}), "
                             f"got {config.blend_check_layer}")
        self.config = config  # the EngineConfig; read on every use, so changes apply at once
        # EngineConfig refuses a mode other than off for these families; a mode set on the config
        # later (a harness flips it between requests) must not bypass that
        self.supported = model.config.traits.segment_reuse_ok
        self.kv = kv
        self.store = SegmentKVStore(config.segment_cache_memory, segment_seed(model_fingerprint, config.dtype),
                                    tiers, model_fingerprint, kv)
        self.blender = Blender(model, kv, self.store)
        self._tokenizer, self._auto = tokenizer, None
        self._pending: list[tuple[Callable[[], object], list]] = []  # (store work, the blocks it holds)
        self.audit, self.breaker = ShadowAudit(), DriftBreaker()
        self._auditing: dict[str, tuple[object, AuditRecord]] = {}  # request id -> (sequence, its rows so far)
        self._piece_ran = False  # an audit piece ran since the last step's forward pass

    @property
    def auto(self) -> AutoReuse | None:
        """Built on first use (reading the vocabulary's break tokens takes a moment)."""
        if self._auto is None and self._tokenizer is not None:
            self._auto = AutoReuse(self.blender, self.store, rule_for(self._tokenizer), self.config.auto_reuse_contexts)
        return self._auto

    @property
    def auto_stats(self):
        """The auto-reuse counters (``AutoStats``), or None before auto reuse was ever used."""
        return self._auto.stats if self._auto is not None else None

    @property
    def enabled(self) -> bool:
        return self.supported and self.config.segment_reuse != "off"

    @property
    def auto_on(self) -> bool:
        return self.supported and self.config.segment_reuse == "auto" and self._tokenizer is not None

    def options(self) -> BlendOptions:
        c = self.config
        auto = c.segment_reuse == "auto"
        selection = c.blend_selection or ("attention" if auto else "deviation")  # see EngineArgs.blend_selection
        return BlendOptions(c.segment_reuse, c.blend_ratio, c.blend_threshold, c.blend_check_layer, selection,
                            floor=auto_floor(self.kv.dtype) if auto else 0.0, head=c.blend_head_tokens,
                            max_drift=c.auto_reuse_max_drift if auto else None)

    def max_drift(self, seq) -> float:
        """The guard's bound for ``seq``: the engine's ``auto_reuse_max_drift``, or the request's own
        (``SamplingParams.extra_args``) where lower."""
        own = seq.params.auto_reuse_max_drift
        return self.config.auto_reuse_max_drift if own is None else min(own, self.config.auto_reuse_max_drift)

    def _auto_candidate(self, s, cache) -> bool:
        """Auto mode, on the step that admits an unmarked prompt: look its chunks up once."""
        seq = s.seq
        if not self.auto_on or seq.auto_checked or seq.output_token_ids or not seq.reads_cache:
            return False
        seq.auto_checked = True
        if self.breaker.off((seq.cache_salt, seq.adapter_id)):
            return False  # its audited answers drifted: ordinary prefills for a while (breaker.py)
        if seq.params.auto_reuse_max_drift == 0:
            return False  # the request asked for an exact prefill
        start = seq.num_computed_tokens
        spans = self.auto.plan(seq.all_token_ids, start, seq.cache_salt, seq.adapter_id)
        if spans is None or cache.allocate_slots(seq, seq.num_tokens) is None:
            return False
        seq.auto_spans = spans
        return True

    def split(self, batch: list, cache) -> tuple[list, list]:
        """Partition a step's (scheduled sequence, block table) pairs into (ordinary, blend).
        A blend sequence has its whole prompt's blocks allocated here."""
        plain, blend = [], []
        for s, table in batch:
            seq = s.seq
            if seq.segments is not None and seq.reads_cache and \
                    cache.allocate_slots(seq, seq.num_tokens) is not None:
                blend.append((s, table))
            elif seq.segments is None and self._auto_candidate(s, cache):
                blend.append((s, table))
            else:
                seq.segments = None
                plain.append((s, table))
        return plain, blend

    def run(self, blend: list, cache) -> torch.Tensor:
        """Blend each sequence's prompt; returns their last-token logits ``[len(blend), V]``.
        Sets ``num_new_tokens`` so that the scheduler's update completes the prompt."""
        opts = self.options()
        return torch.cat([self._blend_one(s, cache, opts) for s, _ in blend])

    def run_isolated(self, blend: list, cache) -> tuple[torch.Tensor | None, list, list]:
        """As :meth:`run`, but a failure belongs to its sequence alone (issue 14): returns
        ``(logits of the sequences that blended, their (scheduled, table) pairs, [(scheduled,
        exception)] of those that failed)``. A failed sequence's blocks are left uncommitted
        (its KV may be half written): the engine fails it and frees them."""
        opts, rows, ok, failed = self.options(), [], [], []
        for pair in blend:
            try:
                rows.append(self._blend_one(pair[0], cache, opts))
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
                failed.append((pair[0], exc))
            else:
                ok.append(pair)
        return (torch.cat(rows) if rows else None), ok, failed

    def harvest(self, batch: list, cache) -> None:
        """Auto mode: store the chunks of every ordinary prompt whose prefill this step
        completes (the runner has written its KV; ``num_computed_tokens`` is not advanced yet),
        once the step is out (:meth:`finish_pending`)."""
        if not self.auto_on:
            return
        for s, table in batch:
            seq = s.seq
            n = seq.num_prompt_tokens
            if not seq.num_computed_tokens < n <= seq.num_computed_tokens + s.num_new_tokens:
                continue
            self._defer(cache, seq.request_id,
                        partial(self.auto.harvest, seq.prompt_token_ids, self.kv.slots(table, n), seq.cache_salt,
                                seq.adapter_id, computed_from=max(seq.num_cached_tokens, 0)))

    def _defer(self, cache, request_id: str, work: Callable[[], object]) -> None:
        self._pending.append((work, cache.hold(request_id)))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending or self._auditing or self.audit.jobs)

    def observe(self, seqs: list, raw: torch.Tensor) -> None:
        """After a step's tokens were sampled and processed: keep the raw logits row (before any
        logits processor) each audited answer's token was drawn from; an answer with
        ``auto_reuse_audit_tokens`` rows, or finished, goes to its audit."""
        if not self._auditing:
            return
        for i, seq in enumerate(seqs):
            entry = self._auditing.get(seq.request_id)
            if entry is None or entry[0] is not seq:  # not audited, or a forked sample of it
                continue
            if seq.num_preemptions != entry[1].preemptions:  # its KV was recomputed: no longer from reuse
                self._close_audit(seq.request_id)
                continue
            entry[1].rows.append(raw[i].float().clone())
            if len(entry[1].rows) >= self.config.auto_reuse_audit_tokens or seq.finish_reason is not None:
                self._close_audit(seq.request_id)

    def _close_audit(self, request_id: str) -> None:
        seq, record = self._auditing.pop(request_id)
        if not record.rows:  # it ended before its first token: nothing to measure
            self._pending.append((lambda: None, record.held))
            return
        self._pending.append((partial(self._begin_audit, record, list(seq.output_token_ids)), record.held))

    def finish_pending(self, cache, audit_budget: int | None = None) -> None:
        """Run the stores deferred by the steps before (module docstring), then drop the references
        that kept their KV in place. A failure costs the store those chunks, never a request. An
        audited request that ended (aborted, failed) or was preempted before its rows were all kept
        is audited on the rows it has. Then the audits under way advance: with ``audit_budget`` (the
        prompt tokens a step may compute beside the requests decoding, engine/pace.py), one piece of
        at most that many positions between two steps (:meth:`stepped`); with None, all to their end."""
        for rid, (seq, record) in list(self._auditing.items()):
            if seq.finish_reason is not None or seq.num_preemptions != record.preemptions:
                self._close_audit(rid)
        pending, self._pending = self._pending, []
        for work, held in pending:
            try:
                work()
            except Exception:  # noqa: BLE001 - storing is an optimisation
                logger.exception("storing the chunks of a prompt failed")
            finally:
                cache.release(held)
        if self.audit.jobs and (audit_budget is None or not self._piece_ran):
            self._piece_ran = audit_budget is not None
            self._judge(self.audit.advance(self.blender.model, audit_budget, self.audit_bound))

    def stepped(self) -> None:
        """A step's forward pass ran: the audits under way may take their next piece."""
        self._piece_ran = False

    @property
    def audit_bound(self) -> float:
        c = self.config
        return c.auto_reuse_audit_bound if c.auto_reuse_audit_bound is not None else c.auto_reuse_max_drift

    def _audit_room(self) -> bool:
        """Whether another audit may open (``shadow.MAX_IN_FLIGHT``); counted as skipped when not."""
        if len(self._auditing) + len(self.audit.jobs) < shadow.MAX_IN_FLIGHT:
            return True
        self.audit.stats.skipped += 1
        return False

    def _begin_audit(self, record: AuditRecord, answer: list[int]) -> None:
        """Start one shadow audit (``shadow.py``); a failure is counted and logged, and costs nothing else."""
        try:
            self.audit.begin(self.kv, record, answer)
        except Exception:  # noqa: BLE001 - an audit observes; it must not fail a step
            self.audit.stats.failed += 1
            logger.exception("auditing an answer from reused KV failed")

    def _judge(self, finished: list) -> None:
        """The completed audits' verdicts to the breaker (``breaker.py``)."""
        c, bound = self.config, self.audit_bound
        for job, kl in finished:
            if self.breaker.record(job.record.namespace, kl > bound, c.auto_reuse_audit_trip):
                logger.warning("automatic reuse off for a namespace of tenant %s for %.0f s: more than %.0f%% of its "
                               "last audited answers drifted over the bound %g", job.record.tenant or "-", TRIP_HOLD_S,
                               100 * c.auto_reuse_audit_trip, bound)

    def _blend_one(self, s, cache, opts: BlendOptions) -> torch.Tensor:
        seq = s.seq
        slots = self.kv.slots(cache.block_table(seq.request_id), seq.num_tokens)
        start = seq.num_computed_tokens
        if seq.auto_spans is not None:
            spans, seq.auto_spans = seq.auto_spans, None
            bound = self.max_drift(seq)
            if opts.max_drift is not None:  # the repair's target: this request's bound
                opts = replace(opts, max_drift=bound)
            res = self.auto.prefill(seq.all_token_ids, spans, slots, start, opts, bound, seq.cache_salt, seq.adapter_id)
            seq.num_auto_tokens, seq.auto_drift, seq.auto_fallback = res.num_reused_tokens, res.drift, res.fell_back
            seq.num_auto_repaired = res.num_repaired_tokens
            self._defer(cache, seq.request_id, partial(self.auto.harvest, seq.prompt_token_ids, slots, seq.cache_salt,
                                                       seq.adapter_id, reused=spans, computed_from=start,
                                                       folds=res.folds))
            if res.num_reused_tokens and self.audit.sampled(self.config.auto_reuse_audit_rate) and self._audit_room():
                self._auditing[seq.request_id] = (seq, AuditRecord(
                    list(seq.prompt_token_ids), slots, start, (seq.cache_salt, seq.adapter_id), seq.tenant,
                    cache.hold(seq.request_id), seq.num_preemptions))
            seq.cache_limit = max(start, res.exact_until)
            s.num_new_tokens = seq.num_tokens - start
            return res.logits
        res = self.blender.prefill(seq.all_token_ids, seq.segments, slots, start, opts,
                                   seq.cache_salt, seq.adapter_id)
        seq.num_segment_tokens = res.num_segment_tokens
        seq.cache_limit = max(start, res.exact_until)
        seq.segments = None
        s.num_new_tokens = seq.num_tokens - start
        return res.logits
