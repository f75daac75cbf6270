"""Response bodies of the OpenAI API, built from the engine's :class:`RequestOutput`.

``usage.prompt_tokens_details.cached_tokens`` is in every usage object: the prompt tokens
whose KV came from the prefix cache instead of being computed; ``segment_tokens`` (a
kvmosaic extension) counts those reused from stored segments at other positions. With
``segment_reuse="auto"`` three more: ``auto_reused_tokens`` (prompt tokens whose KV came from
chunks found automatically, not recomputed), ``auto_reuse_drift`` (the guard's drift estimate,
null when no chunk was found), ``auto_reuse_fallback`` (the guard recomputed the reused part) and
``auto_reuse_repaired_tokens`` (reused tokens the guard had recomputed beyond the ratio to meet its bound).
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine.output_processor import RequestOutput

Decode = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` name for a token in log-probabilities."""
    return f"token_id:{token_id}"


def auto_details(auto: dict | None) -> dict:
    """The auto-reuse fields of ``prompt_tokens_details`` ({} when auto reuse was off)."""
    if auto is None:
        return {}
    return {"auto_reused_tokens": auto["tokens"], "auto_reuse_drift": auto["drift"],
            "auto_reuse_fallback": auto["fallback"], "auto_reuse_repaired_tokens": auto["repaired"]}


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                      "segment_tokens": out.num_segment_tokens, **auto_details(out.auto_reuse)}}


class TextDelta:
    """Turns cumulative texts into increments that never have to be taken back.

    While a request runs, two tails are held back: a trailing U+FFFD (a character whose bytes
    are not all generated yet; it becomes another character later) and the last
    ``len(longest stop string) - 1`` characters (they may be the start of a stop string,
    which the engine cuts from the text). The finished text is sent in full.
    """

    def __init__(self, stops: list[str]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.hold
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


def completion_logprobs(out: RequestOutput, start: int, decode: Decode, offset: int) -> dict | None:
    """OpenAI's legacy shape for tokens ``start:`` of the output; ``offset`` is the text
    offset of the first of them."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lps in zip(out.token_ids[start:], out.logprobs[start:]):
        text = decode(tid)
        tokens.append(text)
        token_lps.append(lps.get(tid))
        tops.append({decode(t): lp for t, lp in lps.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(out: RequestOutput, start: int, decode: Decode, top: int) -> dict | None:
    if out.logprobs is None:
        return None

    def entry(tid: int, lp: float) -> dict:
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for tid, lps in zip(out.token_ids[start:], out.logprobs[start:]):
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(tid, lps[tid]), "top_logprobs": [entry(t, lp) for t, lp in ranked]})
    return {"content": content}


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def completion_choice(index: int, out: RequestOutput, logprobs: dict | None) -> dict:
    return {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason}


def chat_choice(index: int, out: RequestOutput, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def completion_body(rid: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
                     logprobs: dict | None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None,
               logprobs: dict | None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def with_token_ids(body: dict, out: RequestOutput, start: int, first: bool, chat: bool) -> dict:
    """vLLM's ``return_token_ids`` in a streamed chunk (``body``, one choice): the ids generated
    from ``start`` on, and in a choice's first chunk the prompt's (a completion's in its choice, a
    chat's beside the choices, as vLLM places them)."""
    body["choices"][0]["token_ids"] = out.token_ids[start:]
    if first:
        (body if chat else body["choices"][0])["prompt_token_ids"] = out.prompt_token_ids
    return body
