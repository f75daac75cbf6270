"""The engine core: processed requests in, one scheduled forward pass per
:meth:`LLMEngine.step`, outputs out.

Three parts, each with one job (docs/ARCHITECTURE.md, "A request's life"): the
:class:`~.input_processor.InputProcessor` turns any prompt form into token ids once and
validates it; the core here schedules, executes and samples; the
:class:`~.output_processor.OutputProcessor` detokenises, applies stops and builds outputs.
Callers outside the engine (the server, the ``LLM`` API) use only the public methods and
fields below: ``add_request`` / ``add_processed``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``finish_pending``, ``reset_prefix_cache``, ``get_stats``,
``model_info``, ``tokenizer``, ``max_model_len``, ``inputs``, ``events``.

Parallel sampling (``SamplingParams.n > 1``) computes the prompt once and forks the samples
from it (engine/parallel_sampling.py).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable

import torch

from ..blend.engine_hook import SegmentReuse
from ..cache.block_pool import BlockPool
from ..cache.events import EventLog
from ..cache.hash_manager import HashCacheManager
from ..cache.hashing import make_seed
from ..cache.lens import CacheLens
from ..cache.residency import BlockResidency
from ..cache.watch import CacheWatch
from ..kv.connector import KVConnector
from ..kv.paged import PagedKVCache
from ..kv.tiered import make_tier_connector
from ..model import load_model_bundle
from ..model.tokenizer import with_chat_template
from .cache_setup import kv_layout_for, make_cache_manager
from .config import EngineConfig
from .input_processor import InputProcessor, ProcessedPrompt, PromptInput
from .logits_processors import apply_logits_processors
from .model_runner import ModelRunner, StepResult
from .output_processor import OutputProcessor, RequestOutput
from .parallel_sampling import ParallelSampling, child_request_ids
from .prompt_logprobs import record as record_prompt_logprobs
from .sampler import sample_rows, top_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .scored_prefix import ScoredPrefixCache
from .sequence import Sequence
from .stats import EngineStats, ModelInfo, engine_stats
from .structured import GrammarFactory, apply_grammars
from .threads import DEFAULT_THREADS, ThreadBudget

logger = logging.getLogger("kvmosaic.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        self.threads = (ThreadBudget(config.num_threads or DEFAULT_THREADS)
                        if config.adaptive_threads and self.device.type == "cpu" else None)
        bundle = load_model_bundle(config.model, config.dtype, str(self.device), config.quantization,
                                   config.max_model_len)  # longrope's RoPE tables follow the context
        self.model, self.tokenizer = bundle.model, with_chat_template(bundle.tokenizer, config.chat_template)
        self.model_name, self.model_config = bundle.name, bundle.config
        self.model_fingerprint = bundle.fingerprint
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_blocks = config.num_kv_blocks or PagedKVCache.num_blocks_for_budget(
            cfg, config.block_size, config.torch_dtype, config.kv_cache_memory)
        # Sliding-window layers in groups of their own (cache/kv_groups.py): the same memory,
        # in pages of fewer layers; num_blocks stays the classic layout's count (prompt limits).
        self.kv_layout = kv_layout_for(config, [layer.window for layer in self.model.layers])
        self.kv = PagedKVCache(cfg, self.kv_layout.pages_for(num_blocks), config.block_size, config.torch_dtype,
                               self.device, self.kv_layout)
        self.events = EventLog(enabled=config.enable_kv_events)
        # Storage tiers below the pool (kvmosaic/kv/tiered.py; None: off), built first and given
        # to the pool (observer), the cache manager (lookup), the scheduler (its connector) and
        # the segment store at construction (docs/ARCHITECTURE.md, "Storage tiers").
        self.tiers = make_tier_connector(config, self.kv, self.model_fingerprint, self.events)
        if self.tiers is not None:
            self._tiers_finalizer = weakref.finalize(self, self.tiers.close)
        medium = "GPU" if self.device.type == "cuda" else self.device.type.upper()
        # Live miss reasons (issue 23): the watch sees every block enter and leave the index and
        # passes each call on to the tiers' connector.
        self.watch = CacheWatch(self.tiers, max(4 * self.kv.num_blocks, 4096), config.keep_block_tokens) \
            if config.miss_reasons else None
        residency = BlockResidency(config.kv_cache_metrics_sample) if config.kv_cache_metrics_sample else None
        self.pool = BlockPool(self.kv.num_blocks, config.block_size, self.events, config.verify_tokens, medium=medium,
                              observer=self.watch or self.tiers, residency=residency)
        # Told the tokens of every step (vLLM's iteration_tokens_total); set by the server's metrics.
        self.on_iteration: Callable[[int], None] | None = None
        seed = make_seed(self.model_fingerprint, config.dtype, config.block_size, config.hash_algo)
        self.cache = make_cache_manager(config, self.pool, seed, self.tiers, self.kv_layout)
        self.lens = CacheLens(self.cache, self.watch) if self.watch is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                            config.scheduling_policy, fair_chunk_tokens=config.fair_share_chunk_tokens,
                            fair_decode_rows=config.fair_share_decode_rows,
                            fair_anticipation=config.fair_share_anticipation_ms / 1e3,
                            max_decode_stall_ms=config.max_decode_stall_ms),
            self.cache,
            KVConnector(self.tiers, config.block_size) if self.tiers is not None else None,
            self.lens,
        )
        self.runner = ModelRunner(self.model, self.kv, cascade=config.cascade_attention,
                                  batch_invariant=config.batch_invariant)
        if config.scored_prefix_cache_memory and isinstance(self.cache, HashCacheManager) and self.cache.enable_caching:
            self.scheduler.scored = self.runner.scored = ScoredPrefixCache(self.cache, config.scored_prefix_cache_memory)
        self.runner.warm_up()
        self.segment_reuse = SegmentReuse(self.model, self.kv, config, self.model_fingerprint,
                                          self.tiers.stack if self.tiers is not None else None, self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, cfg.vocab_size, self.max_model_len, num_blocks,
                                     config.block_size, config.segment_separator)
        self.outputs = OutputProcessor(self.tokenizer, self.tokenizer.eos_token_id, self.max_model_len,
                                       bundle.stop_token_ids)
        self.model_info = ModelInfo(self.model_name, self.model_fingerprint, config.dtype, config.block_size,
                                    config.hash_algo, self.max_model_len, num_blocks, self.kv.bytes_per_token,
                                    seed, config.prefix_cache, config.quantization)
        self.grammars = GrammarFactory(self.tokenizer, cfg.vocab_size)
        self.requests: dict[str, Sequence] = {}
        self.samples = ParallelSampling(self.outputs)  # n > 1: the samples still to fork
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: PromptInput | ProcessedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate and queue a request; raises ValueError (changing nothing) on bad input.
        ``cache_salt``, when given, overrides the prompt's own."""
        return self.add_processed(self.inputs.process(prompt, cache_salt), params, request_id, adapter_id, priority)

    def add_processed(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        grammar: object | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a prompt the :attr:`inputs` processor already tokenised and validated;
        ``tenant`` names who sent it, for fair share (engine/fair_share.py); ``grammar``: the
        matcher for ``params.grammar``, compiled beforehand (``grammars.matcher``, off the
        engine thread), or None to compile it here; ``arrival_time``: when the request reached
        the server (``time.perf_counter``; default now), where its queue time and TTFT start."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        taken = [i for i in self.child_request_ids(request_id, params.n) if i in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} (sample {taken[0].rsplit('-', 1)[1]} of {request_id!r}) is "
                             f"already in use")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is out of the vocabulary "
                             f"(ids must be in [0, {vocab}))")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} is out of the vocabulary "
                             f"(ids must be in [0, {vocab}))")
        if grammar is None and params.grammar is not None:
            grammar = self.grammars.matcher(params.grammar)
        seq = Sequence(request_id, processed.prompt, processed.prompt_token_ids, params,
                       processed.cache_salt, adapter_id, priority, public_blocks=processed.public_blocks,
                       tenant=tenant)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.grammar = grammar
        seq.segments = processed.segments if self.segment_reuse.enabled else None
        self.requests[request_id] = seq
        self.samples.register(seq)
        self.scheduler.add(seq)
        return seq

    child_request_ids = staticmethod(child_request_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if it was unknown
        or already finished."""
        seq = self.requests.pop(request_id, None)
        self.samples.abort(request_id)
        if seq is None:
            return None
        self.scheduler.abort(request_id)
        seq.finish_reason = "abort"
        return self.outputs.make_output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.finish_pending()  # the last step's deferred work, its outputs being out
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if sched.scheduled:
            now = time.perf_counter()
            for s in sched.scheduled:  # vLLM's queue time ends when a request is first scheduled
                if s.seq.first_scheduled_time is None:
                    s.seq.first_scheduled_time = now
            if self.on_iteration is not None:
                self.on_iteration(sched.num_tokens)
        outputs = [self._retire(seq) for seq in sched.out_of_memory]
        # A storage-tier load that raised fails its request alone (issue 14).
        outputs += [self._fail(seq, msg, "tier_load") for seq, msg in sched.failed]
        if sched.scheduled:
            failed: list = []  # (sequence, message, reason): requests whose own part of the step failed
            try:
                result = self._execute(sched, failed)
            except Exception as exc:  # the whole step failed: fail its batch, free their blocks
                logger.exception("the forward pass failed; failing the %d requests of this step",
                                 len(sched.scheduled))
                return outputs + [self._fail(*f) for f in failed] + [
                    self._fail(s.seq, f"engine error in the forward pass: {exc}", "step") for s in sched.scheduled]
            self.scheduler.update(sched)
            self.segment_reuse.stepped()
            record_prompt_logprobs(result.prompt_logprobs)
            outputs += [self._fail(*f) for f in failed]
            outputs += self._process_samples(result)
        return outputs + self.samples.take_orphans()

    def _fail(self, seq: Sequence, message: str, reason: str) -> RequestOutput:
        """One request failed: it alone ends (``finish_reason == "error"``), its blocks are
        freed, the rest of the batch goes on."""
        self.scheduler.finish(seq, "error")
        seq.finish_time = time.perf_counter()
        self.requests.pop(seq.request_id, None)
        self.samples.end_with(seq, message, reason)
        return self.outputs.make_output(seq, error=message, error_reason=reason)

    def _execute(self, sched: SchedulerOutput, failed: list | None = None) -> StepResult:
        if self.threads is not None:
            self.threads.update()
        copies = self.cache.take_pending_copies()
        if copies:
            self.kv.copy_blocks([(c.src, c.dst, c.num_tokens) for c in copies])
        tables = self.cache.block_tables if self.kv_layout.hybrid else self.cache.block_table
        batch = [(s, tables(s.seq.request_id)) for s in sched.scheduled]
        if not self.segment_reuse.enabled:
            return self._run(batch)
        # Segment reuse: one blend forward per newly admitted segmented prompt.
        batch, blend = self.segment_reuse.split(batch, self.cache)
        result = self._run(batch) if batch else None
        self.segment_reuse.harvest(batch, self.cache)  # auto: chunks of the prompts completed here
        if not blend:
            return result
        # A blend that raises fails its request alone (issue 14): it leaves the step uncommitted.
        logits, blend, bad = self.segment_reuse.run_isolated(blend, self.cache)
        if bad:
            for s, exc in bad:
                logger.warning("request %s failed in segment reuse: %s: %s", s.seq.request_id, type(exc).__name__, exc)
                if failed is None:
                    raise exc
                failed.append((s.seq, f"segment reuse failed: {type(exc).__name__}: {exc}", "segment_reuse"))
            gone = {id(s) for s, _ in bad}
            sched.scheduled = [s for s in sched.scheduled if id(s) not in gone]
        if not blend:
            return result if result is not None else StepResult(torch.empty(0), [])
        blended = StepResult(logits, [s for s, _ in blend])
        if result is None:
            return blended
        return StepResult(torch.cat((result.logits, blended.logits)), result.sampling + blended.sampling,
                          result.prompt_logprobs)

    def _run(self, batch: list) -> StepResult:
        """The runner's forward pass over ``batch``, timed for the prefill pace (engine/pace.py):
        only here, since a blended prompt's tokens cost a fraction of a prefill's and would make
        the pace allow more prompt tokens than the stall target holds (and a step that scored
        prompt log-probabilities costs more than one)."""
        prefill = sum(s.num_new_tokens for s, _ in batch if s.seq.num_uncomputed > 1)
        started = time.perf_counter()
        result = self.runner.execute(batch)
        if not result.prompt_logprobs:  # nor a step that ran the head over prompt rows
            self.scheduler.pace.observe(prefill, time.perf_counter() - started)
        return result

    def _process_samples(self, result: StepResult) -> list[RequestOutput]:
        seqs = [s.seq for s in result.sampling]
        if not seqs:
            return []
        rows = list(range(len(seqs)))
        for i, seq in enumerate(list(seqs)):
            if self.samples.waiting_to_fork(seq.request_id):
                children = self.samples.fork(seq, self.scheduler, self.requests)
                seqs += children
                rows += [i] * len(children)
        raw = result.logits if len(rows) == len(result.sampling) else result.logits[rows]
        logits = apply_logits_processors(raw, seqs, self.outputs.eos_ids)
        logits = apply_grammars(logits, [s.grammar for s in seqs])
        for seq in seqs:  # a seeded request's generator lives on the logits' device
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed)
        tokens = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
        lps = top_logprobs(raw, tokens, [s.params.logprobs for s in seqs])  # vLLM: the raw distribution
        now = time.perf_counter()
        outputs = []
        for seq, tok, lp in zip(seqs, tokens, lps):
            # A failure here belongs to this request alone (issue 14): it fails, the batch goes on.
            if isinstance(tok, Exception):
                outputs.append(self._fail(seq, f"sampling failed: {tok}", "sampling"))
                continue
            try:
                outputs.append(self._process_one(seq, tok, lp, now))
            except Exception as exc:  # noqa: BLE001 - stop handling, detokenisation
                logger.warning("request %s failed while its output was processed: %s: %s",
                               seq.request_id, type(exc).__name__, exc)
                outputs.append(self._fail(seq, f"processing the output failed: {type(exc).__name__}: {exc}",
                                          "output_processing"))
        self.segment_reuse.observe(seqs, raw)  # the shadow audit keeps the rows its answers were drawn from
        return outputs

    def _process_one(self, seq: Sequence, tok: int, lp: dict | None, now: float) -> RequestOutput:
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.parent_id is None:  # a forked sample computed no prompt token
                self.prompt_tokens += seq.num_prompt_tokens
        else:
            seq.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.append_token(tok)
        self.generation_tokens += 1
        if lp is not None:
            seq.output_logprobs.append(lp)
        self.outputs.check_stop(seq, tok)
        if seq.grammar is not None and seq.finish_reason is None:
            seq.grammar.consume_token(tok)
            if seq.grammar.is_stopped():  # the document is complete: nothing more may follow
                seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)
            return self._retire(seq)
        return self.outputs.make_output(seq)

    def _retire(self, seq: Sequence) -> RequestOutput:
        """A finished sequence (its blocks already freed by the scheduler) leaves the engine."""
        seq.finish_time = time.perf_counter()
        self.requests.pop(seq.request_id, None)
        self.samples.end_with(seq)
        return self.outputs.make_output(seq)

    def finish_pending(self) -> None:
        """Work a step deferred past its outputs (automatic reuse's stores and audits: blend/engine_hook.py),
        done now. Every step starts with it; a caller that stops stepping (idle, or done) calls it, so that
        the blocks that work holds go back to the pool. While requests decode, an audit advances one piece
        between two steps (at most the prefill allowance beside decodes, engine/pace.py)."""
        if self.segment_reuse.has_pending:
            self.segment_reuse.finish_pending(self.cache, self.scheduler.decode_allowance())

    # ---- cache control and stats ---------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        self.finish_pending()
        cached = list(self.pool.cached) if self.watch is not None else []
        done = self.cache.reset_prefix_cache()
        if done and self.watch is not None:
            self.watch.on_reset(cached)
        return done

    def close(self) -> None:
        """Finish deferred work (its stores reach the tiers too), flush queued tier writes and release
        the tiers (files, sockets, threads)."""
        self.finish_pending()
        if self.tiers is not None:
            self.tiers.flush()
            self._tiers_finalizer()

    def get_stats(self) -> EngineStats:
        return engine_stats(self)

    def kv_bytes_held(self, request_id: str) -> int:
        """Bytes of the KV pages ``request_id`` holds a reference on, every layer group (a
        window group's given-back blocks not counted; docs/ARCHITECTURE.md, "Hybrid KV layout")."""
        held = (self.cache.held_pages(request_id) if self.kv_layout.hybrid
                else self.cache.block_table(request_id))
        return len(held) * self.kv.page_bytes
