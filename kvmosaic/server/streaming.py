"""A streamed response: the engine's outputs of every choice as server-sent events in OpenAI's
chunk shapes (and vLLM's extra fields).

Invariants: a choice's chunks come in its outputs' order, and its text is never taken back (held
back instead where a stop string or an unfinished character may follow, ``responses.TextDelta``);
its last chunk carries its ``finish_reason``; a failure ends the stream with an explicit error event
and ``[DONE]``, never a silent cut; the usage chunk, when asked for, comes last, before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from ..engine.output_processor import RequestOutput
from . import echo as E
from . import responses as R
from .async_engine import RequestFailed, RequestStream
from .choices import merge
from .choices import usage as usage_of
from .errors import error_body
from .protocol import SamplingFields
from .responses import Decode
from .tools import ToolSession
from .tools import finish_reason as tool_finish

BIG_TEXT = 1 << 16  # characters of a chunk's text past which it is serialised off the event loop


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream_chunks(streams: list[RequestStream], req: SamplingFields, rid: str, created: int, model: str,
                        logprobs: int | None, chat: bool, decode: Decode, decode_ids: Callable[[list[int]], str],
                        tools: ToolSession | None = None) -> AsyncIterator[str]:
    """The server-sent events of a streamed response: every choice's outputs as chunks as they come
    (choice ``i`` is stream ``i``), then the usage chunk when asked, then ``[DONE]``. ``decode``
    names a token in log-probabilities, ``decode_ids`` turns a prompt's ids into its text (echo)."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    texts = [R.TextDelta(req.stop_list) for _ in streams]
    parsers = [tools.stream() for _ in streams] if tools is not None else None
    sent_tokens = [0] * len(streams)
    latest: list[RequestOutput | None] = [None] * len(streams)
    heads = [E.StreamHead(req.echoes, logprobs, decode, decode_ids)
             for _ in streams]
    drop = req.echo_without_generation
    ids = bool(req.return_token_ids)
    started = [False] * len(streams)  # a choice's first chunk with output went out
    if chat:
        for i in range(len(streams)):
            yield sse(R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None,
                                   None, i))
    results = merge(streams)
    try:
        async for i, out in results:
            if drop and out.finished:
                out = E.without_generation(out)
            elif drop:
                continue
            latest[i] = out
            text = texts[i]
            delta = text.next(out.text, out.finished)
            if not delta and not out.finished and logprobs is None:
                continue
            if chat and parsers is not None:  # tool calls: the parser decides what each delta is
                p = parsers[i]
                deltas = p.feed(delta) + (p.finish() if out.finished else [])
                if out.finished and not deltas:
                    deltas = [{}]
                if not deltas:
                    continue  # held back (a tag may be starting); its logprobs go with the next chunk
                lps = R.chat_logprobs(out, sent_tokens[i], decode, logprobs or 0) \
                    if logprobs is not None else None
                finish = tool_finish(R.finish_reason(out), p.calls)
                for j, d in enumerate(deltas):
                    body = R.chat_chunk(rid, created, model, d,
                                        finish if j == len(deltas) - 1 else None, lps if j == 0 else None, i)
                    if ids:
                        R.with_token_ids(body, out, sent_tokens[i] if j == 0 else len(out.token_ids),
                                         not started[i], chat)
                        started[i] = True
                    if include_usage:
                        body["usage"] = usage_of(latest, req.return_miss_reasons) if continuous else None
                    yield sse(body)
                sent_tokens[i] = len(out.token_ids)
                continue
            if chat:
                lps = R.chat_logprobs(out, sent_tokens[i], decode, logprobs or 0) \
                    if logprobs is not None else None
                body = R.chat_chunk(rid, created, model, {"content": delta} if delta else {},
                                    R.finish_reason(out), lps, i)
            else:
                args = (out, delta, sent_tokens[i], text.sent - len(delta))
                if heads[i].offset is None and (heads[i].echo or out.prompt_logprobs is not None):
                    # the prompt's part: thousands of tokens' entries are a second of Python, off the loop
                    piece, lps, extra = await asyncio.to_thread(heads[i].chunk, *args)
                else:
                    piece, lps, extra = heads[i].chunk(*args)
                body = R.completion_chunk(rid, created, model, piece, R.finish_reason(out), lps, i)
                body["choices"][0].update(extra)
            if ids:
                R.with_token_ids(body, out, sent_tokens[i], not started[i], chat)
                started[i] = True
            sent_tokens[i] = len(out.token_ids)
            if include_usage:
                body["usage"] = usage_of(latest, req.return_miss_reasons) if continuous else None
            heavy = len(body["choices"][0].get("text") or "") > BIG_TEXT or "prompt_logprobs" in body["choices"][0]
            yield (await asyncio.to_thread(sse, body)) if heavy else sse(body)
    except RequestFailed as e:  # an explicit error event, then [DONE]: never a silent cut
        yield sse(error_body(e.status, e.message, code=e.reason))
        yield sse("[DONE]")
        return
    finally:
        await results.aclose()
    if include_usage and any(o is not None for o in latest):
        yield sse(R.usage_chunk(rid, created, model,
                                "chat.completion.chunk" if chat else "text_completion", usage_of(latest, req.return_miss_reasons)))
    yield sse("[DONE]")
