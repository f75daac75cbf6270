"""The engine: requests in, one scheduled forward pass per :meth:`LLMEngine.step`, outputs out."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..blend import SegmentedPrompt, parse_segment_prompt, split_on_separator
from ..blend.engine_hook import SegmentReuse
from ..cache.block_pool import BlockPool
from ..cache.events import EventLog
from ..cache.hashing import get_hash_fn, make_seed
from ..cache.manager import HashCacheManager, KVCacheManager
from ..kv.paged import PagedKVCache
from ..model import load_model_bundle
from .config import EngineConfig
from .model_runner import ModelRunner, StepResult
from .sampler import sample, top_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence

PromptInput = str | list[int] | dict


@dataclass
class RequestOutput:
    """What a request produced so far (``finished`` tells whether it is complete)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    num_segment_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens this request actually prefilled."""
        return len(self.prompt_token_ids) - self.num_cached_tokens - self.num_segment_tokens


@dataclass
class EngineStats:
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_evictions: int
    prompt_tokens: int
    generation_tokens: int
    kv_bytes_per_token: int


def make_cache_manager(config: EngineConfig, pool: BlockPool, seed: bytes) -> KVCacheManager:
    hash_fn = get_hash_fn(config.hash_algo)
    pool.set_eviction_policy(config.eviction_policy)
    if config.prefix_cache == "radix":
        from ..cache.radix import RadixCacheManager

        return RadixCacheManager(pool, seed, eviction_policy=config.eviction_policy)
    return HashCacheManager(pool, seed, hash_fn, enable_caching=config.prefix_cache == "hash")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        bundle = load_model_bundle(config.model, config.dtype, str(self.device))
        self.model, self.tokenizer = bundle.model, bundle.tokenizer
        self.model_name, self.model_config = bundle.name, bundle.config
        self.model_fingerprint = bundle.fingerprint
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_blocks = config.num_kv_blocks or PagedKVCache.num_blocks_for_budget(
            cfg, config.block_size, config.torch_dtype, config.kv_cache_memory)
        self.kv = PagedKVCache(cfg, num_blocks, config.block_size, config.torch_dtype, self.device)
        self.events = EventLog(enabled=config.enable_kv_events)
        self.pool = BlockPool(num_blocks, config.block_size, self.events, config.verify_tokens)
        seed = make_seed(self.model_fingerprint, config.dtype, config.block_size, config.hash_algo)
        self.cache = make_cache_manager(config, self.pool, seed)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                            config.scheduling_policy),
            self.cache,
        )
        self.runner = ModelRunner(self.model, self.kv)
        self.segment_reuse = SegmentReuse(self.model, self.kv, config, self.model_fingerprint)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------
    def segmented(self, prompt: PromptInput) -> SegmentedPrompt | None:
        """The prompt's segments: given as ``{"prompt": head, "segments": [doc, ...],
        "suffix": tail}`` (see blend/prompt.py), or marked in a text prompt by the configured
        ``segment_separator``; None for an unsegmented prompt."""
        if isinstance(prompt, SegmentedPrompt):
            return prompt
        if isinstance(prompt, dict) and "segments" in prompt:
            return parse_segment_prompt(self.tokenizer, prompt)
        sep = self.config.segment_separator
        if sep is None:
            return None
        fields = prompt if isinstance(prompt, dict) else {"prompt": prompt}
        text = fields.get("prompt")
        split = split_on_separator(text, sep) if isinstance(text, str) and "prompt_token_ids" not in fields else None
        if split is None:
            return None
        return parse_segment_prompt(self.tokenizer, {**fields, **split})

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        """A prompt is text, token ids, ``{"prompt": text-or-ids, "cache_salt": str}``, or a
        segmented prompt (see :meth:`segmented`)."""
        prompt = self.segmented(prompt) or prompt
        if isinstance(prompt, SegmentedPrompt):
            return prompt.text, prompt.token_ids, prompt.cache_salt
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt fields: {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError("cache_salt must be a non-empty string")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False), salt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt), salt
        raise ValueError("a prompt must be a string, a list of token ids, or a dict with 'prompt'")

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate and queue a request; raises ValueError (changing nothing) on bad input."""
        params = params or SamplingParams()
        segmented = self.segmented(prompt)
        text, ids, salt = self.tokenize(segmented or prompt)
        salt = cache_salt if cache_salt is not None else salt
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}")
        if len(ids) // self.config.block_size + 2 > self.pool.num_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the pool has ({self.pool.num_blocks})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, text, ids, params, salt, adapter_id, priority)
        if segmented is not None and segmented.spans and self.segment_reuse.enabled:
            seq.segments = segmented.spans
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(request_id)
            seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        outputs = [self._retire(seq) for seq in sched.out_of_memory]
        if sched.scheduled:
            result = self._execute(sched)
            self.scheduler.update(sched)
            outputs += self._process_samples(result)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        copies = self.cache.take_pending_copies()
        if copies:
            self.kv.copy_blocks([(c.src, c.dst, c.num_tokens) for c in copies])
        batch = [(s, self.cache.block_table(s.seq.request_id)) for s in sched.scheduled]
        if not self.segment_reuse.enabled:
            return self.runner.execute(batch)
        # Segment reuse: one blend forward per newly admitted segmented prompt.
        batch, blend = self.segment_reuse.split(batch, self.cache)
        result = self.runner.execute(batch) if batch else None
        if not blend:
            return result
        blended = StepResult(self.segment_reuse.run(blend, self.cache), [s for s, _ in blend])
        if result is None:
            return blended
        return StepResult(torch.cat((result.logits, blended.logits)), result.sampling + blended.sampling)

    def _process_samples(self, result: StepResult) -> list[RequestOutput]:
        seqs = [s.seq for s in result.sampling]
        if not seqs:
            return []
        logits = result.logits
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        lps = top_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
        now = time.perf_counter()
        outputs = []
        for seq, tok, lp in zip(seqs, tokens, lps):
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.prompt_tokens += seq.num_prompt_tokens
            seq.append_token(tok)
            self.generation_tokens += 1
            if lp is not None:
                seq.output_logprobs.append(lp)
            self._check_stop(seq, tok)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                outputs.append(self._retire(seq))
            else:
                outputs.append(self.make_output(seq))
        return outputs

    def _retire(self, seq: Sequence) -> RequestOutput:
        """A finished sequence (its blocks already freed by the scheduler) leaves the engine."""
        seq.finish_time = time.perf_counter()
        self.requests.pop(seq.request_id, None)
        return self.make_output(seq)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if (tok == self.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", (None if tok == self.eos_token_id else tok)
            seq.output_text = self._detok(seq.output_token_ids[:-1])
            return
        checked = len(seq.output_text)
        seq.output_text = self._detok(seq.output_token_ids)
        for stop in p.stop:
            # Only the new tail can hold a new match: the text before it was checked already.
            idx = seq.output_text.find(stop, max(0, checked - len(stop) + 1))
            if idx >= 0:
                cut = idx + len(stop) if p.include_stop_str_in_output else idx
                seq.output_text = seq.output_text[:cut]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _detok(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def make_output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_segment_tokens=seq.num_segment_tokens,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            metrics={"arrival_time": seq.arrival_time, "ttft": seq.ttft,
                     "e2e": (seq.finish_time - seq.arrival_time) if seq.finish_time else None,
                     "num_preemptions": seq.num_preemptions},
        )

    # ---- cache control and stats ---------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.cache.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        st, size = self.cache.stats, self.cache.size_info()
        return EngineStats(
            prefix_cache_queries=st.queries,
            prefix_cache_hits=st.hits,
            prefix_cache_hit_rate=st.hit_rate,
            kv_cache_usage=size.in_use / size.total,
            num_blocks=size.total,
            num_free_blocks=size.free + size.evictable,
            num_cached_blocks=size.cached,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.num_preemptions,
            num_evictions=self.pool.num_evictions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            kv_bytes_per_token=self.kv.bytes_per_token,
        )
