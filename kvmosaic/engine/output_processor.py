"""Output processing: after a token is sampled, detokenise, check stops, build the output.

Everything here belongs to one request: a failure while processing one sequence's token
concerns that sequence alone (the engine fails that request and keeps the batch going).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from .sequence import Sequence


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
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token: log-probability}
    # for each (the prompt's own token and the top-k); None when not asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank at its position (1: most likely)
    num_segment_tokens: int = 0
    # Automatic segment reuse (segment_reuse="auto"): None when the engine did not look for
    # chunks; else {"tokens": reused tokens kept, "drift": the guard's estimate (None when
    # nothing was found), "fallback": whether the guard recomputed the uncertain part,
    # "repaired": reused tokens recomputed beyond the ratio to meet the guard's bound}.
    auto_reuse: dict | None = None
    metrics: dict = field(default_factory=dict)
    # Set when the request failed (``finish_reason == "error"``): what went wrong, and a
    # short reason for metrics ("sampling", "output_processing", "step").
    error: str | None = None
    error_reason: str | None = None
    # Parallel sampling: the choice index, and the request whose prompt this sample forked from.
    index: int = 0
    parent_request_id: str | None = None
    # Missed prompt tokens by reason, the caller's namespace only (cache/miss_reasons.py).
    miss_reasons: dict | None = None

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens this request actually prefilled."""
        auto = self.auto_reuse["tokens"] if self.auto_reuse else 0
        return len(self.prompt_token_ids) - self.num_cached_tokens - self.num_segment_tokens - auto


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection hook (tests and the reliability suite)."""


# Fault injection for tests: a request whose prompt contains this marker raises while its
# third token is processed (set the environment variable, or ``fault_marker``).
FAULT_ENV = "KVMOSAIC_FAULT_INJECTION"


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int,
                 extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's: incremental decoding
        self.eos_token_id = eos_token_id
        # every id that ends a generation as EOS does (the model's generation_config.json)
        self.eos_ids = frozenset((() if eos_token_id is None else (eos_token_id,)) + tuple(extra_eos_ids))
        self.max_model_len = max_model_len
        self.fault_marker: str | None = os.environ.get(FAULT_ENV) or None

    def check_stop(self, seq: Sequence, tok: int) -> None:
        """After ``tok`` was appended: set ``finish_reason`` (and the visible text) if the
        sequence is done: EOS or a stop token, a stop string, ``max_tokens`` or the context."""
        p = seq.params
        if self.fault_marker and seq.prompt and self.fault_marker in seq.prompt and len(seq.output_token_ids) >= 3:
            raise InjectedFault(f"injected fault in request {seq.request_id}")
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", (None if tok in self.eos_ids else tok)
            seq.output_text = self.detokenize(seq.output_token_ids[:-1], p.skip_special_tokens)
            return
        checked = len(seq.output_text)
        seq.output_text = self._text_so_far(seq)
        for stop in (p.stop if len(seq.output_token_ids) > p.min_tokens else ()):  # vLLM: none before min_tokens
            # Only the new tail can hold a new match: the text before it was checked already.
            idx = seq.output_text.find(stop, max(0, checked - len(stop) + 1))
            if idx >= 0:
                cut = idx + len(stop) if p.include_stop_str_in_output else idx
                seq.output_text = seq.output_text[:cut]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            # the whole text once: what the stream still held back (an incomplete character) included
            seq.output_text = self.detokenize(seq.output_token_ids, p.skip_special_tokens)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _text_so_far(self, seq: Sequence) -> str:
        """The output's text, decoded incrementally: each step feeds the new token to the fast
        tokenizer's ``DecodeStream`` (O(1) a token, where decoding every id again was O(n)). Its
        text equals ``detokenize`` of the ids but for a trailing incomplete character, which the
        stream holds back until the token that completes it; a sequence that ends by length or a
        stop token is decoded whole once (check_stop). State on the sequence; rebuilt from the ids
        if they did not grow by exactly one."""
        ids, skip = seq.output_token_ids, seq.params.skip_special_tokens
        if self.backend is None:
            return self.detokenize(ids, skip)
        stream, fed, text = seq.detokenizer or (None, 0, "")
        if stream is None or fed != len(ids) - 1:
            stream, fed, text = DecodeStream(skip_special_tokens=skip), 0, ""
        for token in ids[fed:]:
            text += stream.step(self.backend, token) or ""
        seq.detokenizer = (stream, len(ids), text)
        return text

    @staticmethod
    def make_output(seq: Sequence, error: str | None = None, error_reason: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_segment_tokens=seq.num_segment_tokens,
            auto_reuse=({"tokens": seq.num_auto_tokens, "drift": seq.auto_drift, "fallback": seq.auto_fallback,
                         "repaired": seq.num_auto_repaired}
                        if seq.auto_checked else None),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,  # complete once the first token is out; never changed after
            prompt_ranks=seq.prompt_ranks,
            metrics={"arrival_time": seq.arrival_time, "ttft": seq.ttft,
                     "e2e": (seq.finish_time - seq.arrival_time) if seq.finish_time else None,
                     "num_preemptions": seq.num_preemptions, **(phase_metrics(seq) if seq.finished else {})},
            error=error,
            error_reason=error_reason,
            index=seq.index,
            parent_request_id=seq.parent_id,
            miss_reasons=seq.miss_reasons,
        )


def phase_metrics(seq: Sequence) -> dict:
    """What vLLM's per-request histograms need, taken once, when the request finishes."""
    return {"first_scheduled_time": seq.first_scheduled_time, "first_token_time": seq.first_token_time,
            "last_token_time": seq.last_token_time, "finish_time": seq.finish_time,
            "itl": list(seq.inter_token_latencies), "num_tier_tokens": seq.num_tier_tokens,
            "max_tokens": seq.params.max_tokens, "n": seq.params.n}
