"""Several choices in one response: a request's prompts x ``n`` samples, each an engine request
with its own :class:`RequestStream`, merged into one sequence of ``(choice index, output)``.

Invariants: choice ``i`` is stream ``i`` (``prompt_index * n + sample_index``, OpenAI's order
for a list of prompts); outputs of one choice arrive in order; the merge ends when every
stream has finished, and raises the first failure (:class:`RequestFailed`) of any of them; a
merge that is closed early (client gone, failure) stops its readers. The caller aborts the
engine requests (aborting a finished one does nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..engine.output_processor import RequestOutput
from .async_engine import RequestStream
from .responses import auto_details

_DONE = object()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every output of every stream, tagged with its stream's index, as they come."""
    if len(streams) == 1:  # the common case: no task, no queue
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _DONE))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is _DONE:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in readers:
            task.cancel()


def usage(outs: list[RequestOutput | None], miss_reasons: bool = False) -> dict:
    """vLLM's sums: each prompt's tokens (and cached tokens) once — from its first sample —
    and every choice's completion tokens. ``miss_reasons`` (opt-in, issue 23): the prompts'
    missed tokens by reason, as the engine counted them in the caller's own namespace."""
    firsts = [o for o in outs if o is not None and o.index == 0]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs if o is not None)
    details = {"cached_tokens": sum(o.num_cached_tokens for o in firsts),
               "segment_tokens": sum(o.num_segment_tokens for o in firsts)}
    if miss_reasons:
        reasons: dict[str, int] = {}
        for o in firsts:
            for k, v in (o.miss_reasons or {}).items():
                reasons[k] = reasons.get(k, 0) + v
        details["miss_reasons"] = reasons
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {**details, **_auto(firsts)}}


def _auto(firsts: list[RequestOutput]) -> dict:
    """Auto-reuse fields over several prompts: tokens summed, the largest drift, any fallback, repairs summed."""
    autos = [o.auto_reuse for o in firsts if o.auto_reuse is not None]
    if not autos:
        return {}
    drifts = [a["drift"] for a in autos if a["drift"] is not None]
    return auto_details({"tokens": sum(a["tokens"] for a in autos), "drift": max(drifts) if drifts else None,
                         "fallback": any(a["fallback"] for a in autos),
                         "repaired": sum(a["repaired"] for a in autos)})
