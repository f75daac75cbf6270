"""The completions API's ``echo`` and vLLM's ``prompt_logprobs``, shaped from a
:class:`RequestOutput` whose engine request asked for prompt log-probabilities
(``SamplingParams.prompt_logprobs``: vLLM's rule, ``prompt_logprobs`` or, with ``echo``, ``logprobs``).

With ``echo`` a choice's text is the prompt's and then the completion's, and its legacy ``logprobs``
(tokens, token_logprobs, top_logprobs, text_offset) cover the prompt's tokens first, the first
token's entry null (nothing predicts it). ``echo`` with ``max_tokens`` 0 returns the prompt alone, as
OpenAI's API did for scoring (lm-evaluation-harness's log-likelihood requests): the engine computes
one token, which is dropped (``without_generation``). ``prompt_logprobs`` is vLLM's field: per prompt
token null or ``{token id: {"logprob", "rank", "decoded_token"}}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..engine.output_processor import RequestOutput
from . import responses as R
from .responses import Decode


def prompt_text(out: RequestOutput, decode_ids: Callable[[list[int]], str]) -> str:
    """The prompt as text: as it was sent, or decoded where it came as token ids."""
    return out.prompt if isinstance(out.prompt, str) else decode_ids(out.prompt_token_ids)


def without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with its generated token dropped (``echo`` with ``max_tokens`` 0)."""
    return dataclasses.replace(out, text="", token_ids=[], logprobs=[] if out.logprobs is not None else None,
                               finish_reason="length", stop_reason=None)


def echo_logprobs(out: RequestOutput, decode: Decode) -> tuple[dict, int]:
    """The legacy ``logprobs`` of the prompt's tokens, and the text offset after them."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for i, tid in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[i] if out.prompt_logprobs is not None else None
        text = decode(tid)
        tokens.append(text)
        token_lps.append(None if entry is None else entry.get(tid))
        tops.append(None if entry is None else {decode(t): lp for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def joined(first: dict, then: dict | None) -> dict:
    """Two legacy ``logprobs`` objects, one after the other."""
    return first if then is None else {k: first[k] + then[k] for k in first}


def prompt_logprobs(out: RequestOutput, decode: Decode) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: the prompt's own token with its rank, and the top-k ranked in
    order."""
    if out.prompt_logprobs is None:
        return None
    field: list[dict | None] = []
    for i, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            field.append(None)
            continue
        own = out.prompt_token_ids[i]
        ranked = sorted((t for t in entry if t != own), key=lambda t: -entry[t])
        ranks = {t: r for r, t in enumerate(ranked, 1)}
        ranks[own] = out.prompt_ranks[i] if out.prompt_ranks is not None else None
        for t in ranked:  # the prompt's token among the top-k moves the others below it
            if ranks[own] is not None and ranks[t] >= ranks[own]:
                ranks[t] += 1
        field.append({str(t): {"logprob": lp, "rank": ranks[t], "decoded_token": decode(t)}
                      for t, lp in entry.items()})
    return field


def completion_choice(index: int, out: RequestOutput, echo: bool, logprobs: int | None, decode: Decode,
                      decode_ids: Callable[[list[int]], str], token_ids: bool = False) -> dict:
    """A whole completions choice (a forked sample carries its prompt's log-probabilities too);
    ``token_ids``: vLLM's ``return_token_ids``."""
    lps = R.completion_logprobs(out, 0, decode, 0) if logprobs is not None else None
    choice = R.completion_choice(index, out, lps)
    if token_ids:
        choice["token_ids"], choice["prompt_token_ids"] = out.token_ids, out.prompt_token_ids
    if echo:
        choice["text"] = prompt_text(out, decode_ids) + out.text
        if logprobs is not None:
            head, offset = echo_logprobs(out, decode)
            choice["logprobs"] = joined(head, R.completion_logprobs(out, 0, decode, offset))
    if out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(out, decode)
    return choice


class StreamHead:
    """A streamed completions choice's prompt part: its first chunk carries the prompt's text (with
    ``echo``), the prompt's legacy ``logprobs`` before the completion's, and ``prompt_logprobs``;
    later chunks' text offsets count from the end of the prompt's tokens."""

    def __init__(self, echo: bool, logprobs: int | None, decode: Decode,
                 decode_ids: Callable[[list[int]], str]) -> None:
        self.echo, self.logprobs, self.decode, self.decode_ids = echo, logprobs, decode, decode_ids
        self.offset: int | None = None  # set once the first chunk went out

    def chunk(self, out: RequestOutput, delta: str, start: int, text_offset: int) -> tuple[str, dict | None, dict]:
        """(text, legacy logprobs, extra fields) of a chunk carrying ``delta`` and the generated
        tokens from ``start`` on, the first at ``text_offset`` in the completion's text."""
        extra: dict = {}
        if self.offset is not None:
            lps = R.completion_logprobs(out, start, self.decode, self.offset + text_offset) \
                if self.logprobs is not None else None
            return delta, lps, extra
        self.offset = 0
        head_lps = None
        if self.echo:
            delta = prompt_text(out, self.decode_ids) + delta
            if self.logprobs is not None:
                head_lps, self.offset = echo_logprobs(out, self.decode)
        if out.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs(out, self.decode)
        lps = R.completion_logprobs(out, start, self.decode, self.offset + text_offset) \
            if self.logprobs is not None else None
        return delta, (lps if head_lps is None else joined(head_lps, lps)), extra
