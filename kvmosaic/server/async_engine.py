"""One :class:`LLMEngine`, driven by one background thread, shared by many asyncio clients.

Invariants:

* only the engine thread touches the engine. Other threads reach it through :meth:`call`
  (a function run between two steps, whose result or exception comes back to the caller),
  so a request joins the running batch at the next step and a failed ``add_request``
  changes nothing (the engine validates before it queues);
* every request added through :meth:`add` has a :class:`RequestStream` until it finishes or
  is aborted; its outputs arrive in order and the last one is ``finished``;
* a client that goes away aborts its request (:meth:`abort`), which frees its blocks at the
  next step boundary; aborting a finished or unknown request does nothing;
* prompts are tokenised and validated by the engine's (stateless) input processor on a
  worker thread, not on the engine thread, so a large prompt never stalls a running step;
* the engine thread is the only thread that runs torch, from the model's loading on
  (:meth:`AsyncEngine.launch`): OpenMP keeps one worker pool per thread that starts parallel
  work, and with the main thread's pool from loading beside the engine thread's, libgomp
  counts more workers than cores and stops letting them spin (a decode step measured 1.8x
  slower on two cores);
* after every step and every batch of calls ``on_flush`` hands the drained cache events
  (and the count of any the log had to drop) to the publisher. Statistics are taken on
  demand (:meth:`refresh_stats`, on the engine thread), never per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..engine.input_processor import PromptInput
from ..engine.llm_engine import LLMEngine, RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.stats import EngineStats, ModelInfo

log = logging.getLogger("kvmosaic.server")


class RequestFailed(Exception):
    """The request ended without finishing: ``status`` is the HTTP status to answer with,
    ``reason`` the label it is counted under on /metrics."""

    def __init__(self, message: str, status: int = 500, reason: str = "error") -> None:
        super().__init__(message)
        self.message, self.status, self.reason = message, status, reason


class RequestAborted(RequestFailed):
    """The request was aborted before it finished (its client left, or the server cut it)."""

    def __init__(self, message: str, status: int = 499, reason: str = "client_disconnect") -> None:
        super().__init__(message, status, reason)


class RequestStream:
    """The outputs of one request, consumed by one asyncio task. Outputs are cumulative, so
    when several are queued the consumer skips to the newest."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread. After the event loop closed (shutdown) there is
        nobody left to tell."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
                item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_flush: Callable[[list, int], None] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
        on_count: Callable[[str, str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_flush = on_flush or (lambda events, dropped: None)
        self.on_finish = on_finish or (lambda out: None)
        # ``on_count(kind, reason)``: kind "abort" or "failure" (metrics count both by reason)
        self.on_count = on_count or (lambda kind, reason: None)
        self.stats: EngineStats = engine.get_stats()
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future | None]] = \
            queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmosaic-engine", daemon=True)

    @classmethod
    def launch(cls, make_engine: Callable[[], LLMEngine], **callbacks) -> AsyncEngine:
        """Build the engine on a new engine thread and run it there; return once it is built
        (an error while building is raised here). ``callbacks``: as for the constructor."""
        built: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

        def build_and_run() -> None:
            try:
                built.set_result(cls(make_engine(), **callbacks))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller
                built.set_exception(exc)
                return
            built.result()._loop()

        thread = threading.Thread(target=build_and_run, name="kvmosaic-engine", daemon=True)
        thread.start()
        async_engine = built.result()
        async_engine._thread = thread
        return async_engine

    # ---- any thread ----------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        """The engine's tokenizer (its chat template too); safe to use from any thread."""
        return self.engine.tokenizer

    async def refresh_stats(self, timeout: float = 1.0) -> EngineStats:
        """A fresh snapshot of the engine's counters, taken between two steps; the previous
        one when the engine thread is busy for longer than ``timeout`` seconds (a probe must
        not wait for a long prefill)."""
        try:
            self.stats = await asyncio.wait_for(asyncio.shield(self.call(lambda e: e.get_stats())), timeout)
        except asyncio.TimeoutError:
            pass
        return self.stats

    def start(self) -> None:
        """Start the engine thread (a launched engine's runs already)."""
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        self._calls.put((lambda e: None, None))
        self._thread.join(timeout=30)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        return await asyncio.wrap_future(fut)

    async def add(
        self,
        prompt: PromptInput,
        make_params: Callable[[int], SamplingParams],
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> RequestStream:
        """Tokenise and validate (off the engine thread), build the sampling parameters for
        the prompt's length (``make_params`` may raise ValueError, e.g. when the context is
        too short) and queue the request as ``tenant``'s (fair share). Errors reach the caller
        and change nothing. One stream: ``make_params`` must give ``n == 1`` (else
        :meth:`add_samples`)."""
        streams = await self.add_samples(prompt, make_params, cache_salt, tenant)
        if len(streams) != 1:
            for s in streams:
                self.abort(s.request_id)
            raise ValueError("add() takes n = 1; use add_samples() for n > 1")
        return streams[0]

    async def add_samples(
        self,
        prompt: PromptInput,
        make_params: Callable[[int], SamplingParams],
        cache_salt: str | None = None,
        tenant: str | None = None,
        truncate: int | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """As :meth:`add`, for ``n`` samples of the prompt: one stream per sample, in choice
        order (the engine forks samples 1..n-1 once the prompt is computed; their request ids
        are ``LLMEngine.child_request_ids``). Abort every stream's request to cancel it.
        ``truncate``: ``InputProcessor.process``'s; ``priority``: the engine's (higher first)."""
        loop = asyncio.get_running_loop()
        arrival = time.perf_counter()
        rid = f"req-{uuid.uuid4().hex}"
        processed = await asyncio.to_thread(self.engine.inputs.process, prompt, cache_salt, truncate)
        params = make_params(len(processed.prompt_token_ids))
        grammar = None
        if params.grammar is not None:  # compiled here, not on the engine thread
            grammar = await asyncio.to_thread(self.engine.grammars.matcher, params.grammar)
        streams = [RequestStream(i, loop) for i in (rid, *LLMEngine.child_request_ids(rid, params.n))]

        def add(engine: LLMEngine) -> None:
            engine.add_processed(processed, params, request_id=rid, priority=priority, tenant=tenant, grammar=grammar,
                                 arrival_time=arrival)
            for s in streams:
                self._streams[s.request_id] = s

        try:
            await self.call(add)
        except asyncio.CancelledError:
            for s in streams:  # the add may still run: undo it after
                self.abort(s.request_id)
            raise
        return streams

    def abort(self, request_id: str, reason: str = "client_disconnect") -> None:
        """Fire and forget; safe from any thread, for finished or unknown requests too."""
        self._calls.put((lambda engine: self._abort(request_id, reason), None))

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (a racy read from any thread is fine)."""
        return len(self._streams)

    def cut_all(self, message: str, status: int = 503, reason: str = "shutdown") -> None:
        """End every request in flight with an explicit error (a drain's deadline passed)."""
        def cut(engine: LLMEngine) -> None:
            for request_id in list(self._streams):
                self._abort(request_id, reason, RequestAborted(message, status, reason))
        self._calls.put((cut, None))

    # ---- the engine thread ---------------------------------------------------------------
    def _abort(self, request_id: str, reason: str = "client_disconnect",
               exc: RequestFailed | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if out is None:
            return
        self.on_finish(out)
        self._count("abort", reason)
        if stream is not None:
            stream.put(exc or RequestAborted(f"request {request_id} was aborted", reason=reason))

    def _count(self, kind: str, reason: str) -> None:
        try:
            self.on_count(kind, reason)
        except Exception:
            log.exception("counting a %s failed", kind)

    def _run_calls(self, wait: float) -> bool:
        """Run the calls queued, waiting up to ``wait`` seconds for the first; False: none came."""
        try:
            fn, fut = self._calls.get(timeout=wait) if wait > 0 else self._calls.get_nowait()
        except queue.Empty:
            return False
        while True:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if fut is None:
                    log.exception("engine call failed")
                else:
                    fut.set_exception(exc)
            else:
                if fut is not None:
                    fut.set_result(result)
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug outside any one request: fail those in flight, keep serving
            log.exception("engine step failed; failing %d requests", len(self._streams))
            for request_id in list(self._streams):
                self._abort(request_id, "step_error",
                            RequestFailed(f"engine error: {exc}", 500, "step"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.on_finish(out)
                if out.error is not None:  # this request alone failed (see LLMEngine._fail)
                    self._count("failure", out.error_reason or "error")
                    if stream is not None:
                        stream.put(RequestFailed(out.error, 500, out.error_reason or "error"))
                    continue
            if stream is not None:
                stream.put(out)

    def _flush(self) -> None:
        events, dropped = self.engine.events.drain()
        if events or dropped:
            try:
                self.on_flush(events, dropped)
            except Exception:
                log.exception("publishing cache events failed")

    def _anticipate(self) -> None:
        """Hold the next step while the scheduler expects a one-request-at-a-time tenant's next
        request (engine/anticipation.py), running calls as they come."""
        scheduler = self.engine.scheduler
        while (wait := scheduler.hold()) > 0:
            t0 = time.perf_counter()
            came = self._run_calls(wait)
            scheduler.anticipation.waited(time.perf_counter() - t0)
            if not came:
                return

    def _loop(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._run_calls(0.0 if busy else 0.5)
            if busy:
                self._anticipate()
            if self.engine.has_unfinished_requests():
                self._step()  # its outputs are out to their streams: what it deferred runs now
            self.engine.finish_pending()
            self._flush()
