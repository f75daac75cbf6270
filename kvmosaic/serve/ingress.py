"""The Ray front of ``kvmosaic serve --replicas N``: the OpenAI API in front of the replicas.

The front adds routing and nothing else (docs/ARCHITECTURE.md, "Replicas"): each replica runs
the single-process server's app from the same ``ServerArgs``, so validation, tenancy and
answers are the replica's. The front's own part:

* **limits and drain, as one server's**: body size, header caps, body read timeout, and on
  SIGTERM (``kvmosaic serve``'s driver calls :meth:`OpenAIIngress.begin_drain`) new requests
  get 503 while running ones finish; at the deadline the replicas end the rest with an error;
* **authentication before routing**: a bad key is a 401 here, costing no replica; the tenant's
  salt (same secret as the replicas') names the hashes the router looks up;
* **forwarding, streamed**: ``EngineReplica.handle`` is a generator, called with
  ``stream=True``; the head decides: a stream is relayed chunk by chunk, any other answer is
  collected whole first. Invariant: a replica that dies before the head (any request) or
  before the whole body (non-streamed) is retried on another, up to ``retries`` times, so
  nothing reached the client twice; one that dies mid-stream ends the stream with an explicit
  error event and ``[DONE]``;
* **one place to look**: ``/metrics`` (router metrics, then every replica's with a
  ``replica`` label), ``/health`` (each replica; 503 when none can serve), ``/router/state``.

The router runs in this process (Ray Serve runs a handle's ``RequestRouter`` where the handle
is owned); the ingress finds it in ``serve.state`` to count reported ``cached_tokens`` against
its prediction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ..router.prompt_hashes import prompt_token_ids
from ..server.drain import Drain
from ..server.errors import error_body
from ..server.tokenizer import tokenizer_for
from . import state as serve_state

log = logging.getLogger("kvmosaic.serve")
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
DROPPED_HEADERS = ("content-length", "transfer-encoding", "connection", "date", "server")


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def last_usage(tail: bytes) -> dict | None:
    """The ``usage`` of the last SSE event that has one (``stream_options.include_usage``)."""
    for line in reversed(tail.decode("utf-8", "replace").split("\n")):
        if line.startswith("data: {") and '"usage"' in line:
            try:
                return json.loads(line[6:]).get("usage")
            except json.JSONDecodeError:
                return None
    return None


class Answer:
    """A replica's answer: its head, and the body (whole) or the generator still streaming it."""

    def __init__(self, head: dict, body: bytes | None, gen, attempts: int, key: str) -> None:
        self.status, self.replica, self.attempts = head["status"], head.get("replica", ""), attempts
        self.headers = {k: v for k, v in head["headers"] if k.lower() not in DROPPED_HEADERS}
        self.body, self.gen, self.key = body, gen, key
        self.first: bytes = head.get("first", b"")

    def json(self) -> dict:
        try:
            return json.loads(self.body or b"")
        except ValueError:
            return {"status": "unreadable"}

    @property
    def streaming(self) -> bool:
        return self.body is None


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)  # async relaying: no CPU reserved
@serve.ingress()
class OpenAIIngress:
    def __init__(self, engines, engine_args, server_args, retries: int = 3) -> None:
        self.engines, self.retries = engines, retries
        self.args = server_args
        self.tenants = server_args.tenant_policy()
        self.drain = Drain(server_args.shutdown_timeout)
        self.tokenizer = tokenizer_for(engine_args.model, engine_args.chat_template)

    def __serve_build_asgi_app__(self):
        from .front import build_front

        return build_front(self)

    # ---- forwarding ----------------------------------------------------------------------
    async def routing_data(self, headers: dict[str, str], body: bytes, chat: bool) -> dict[str, Any]:
        """Authenticate (401 here), then the salt and prompt token ids the router needs; a body
        the replica will refuse gets no routing data (the replica answers it)."""
        token = self.tenants.authenticate(headers.get("authorization"))

        def parse() -> dict[str, Any]:  # one hop to a worker thread: parsing, salt, tokens
            parsed = json.loads(body)
            return {"cache_salt": self.tenants.cache_salt(token, parsed.get("cache_salt")),
                    "token_ids": prompt_token_ids(self.tokenizer, parsed, chat)}

        try:
            return await asyncio.to_thread(parse)
        except Exception:  # noqa: BLE001 - an invalid request is answered by the replica
            return {"token_ids": []}

    async def ask(self, method: str, path: str, headers: dict[str, str], body: bytes = b"",
                  extra: dict[str, Any] | None = None, pin: str | None = None) -> Answer:
        """Send one request to a replica (the router's choice, or ``pin``) and wait for its head
        (and, unless it streams, its whole body), retrying elsewhere while nothing was sent."""
        routed: dict[str, Any] = {"method": method, "path": path, "body": body, "key": uuid.uuid4().hex,
                                  "headers": [(k, v) for k, v in headers.items() if k in FORWARDED_HEADERS],
                                  **(extra or {})}
        if pin is not None:
            routed["pin"] = pin
        for attempt in range(1, self.retries + 2):
            gen = self.engines.options(stream=True, method_name="handle").remote(routed)
            try:
                head = await gen.__anext__()
                if dict(head["headers"]).get("content-type", "").startswith("text/event-stream"):
                    return Answer(head, None, gen, attempt, routed["key"])
                body = head.get("first", b"") + b"".join([chunk async for chunk in gen])
                self.observe(routed, head["status"], last_usage_of_json(body))
                return Answer(head, body, None, attempt, routed["key"])
            except REPLICA_GONE as e:
                log.warning("replica died before answering %s (attempt %d): %s", path, attempt, e)
                self.finished(routed)
                if pin is not None:
                    break
        raise ReplicaUnavailable(f"no replica could answer (tried {attempt} times)")

    async def relay(self, answer: Answer) -> AsyncIterator[bytes]:
        """A streamed answer's chunks as the replica makes them; a replica lost mid-stream ends it
        with an error event and ``[DONE]``; a client that leaves cancels the replica's stream."""
        tail, done = answer.first[-8192:], False
        try:
            if answer.first:
                yield answer.first
            async for chunk in answer.gen:
                tail = (tail + chunk)[-8192:]
                yield chunk
            done = True
            if not tail.rstrip().endswith(b"data: [DONE]"):  # the replica's stream stopped short
                raise RayActorError(f"the stream from replica {answer.replica} ended without [DONE]")
        except REPLICA_GONE as e:
            log.warning("replica %s died mid-stream: %s", answer.replica, e)
            yield sse(error_body(502, "the replica serving this stream failed before it finished; retry the "
                                      "request", code="replica_failed"))
            yield sse("[DONE]")
        finally:
            if not done:
                answer.gen.cancel()
            usage = last_usage(tail)
            self.observe({"key": answer.key}, answer.status, usage)

    # ---- the router's books ---------------------------------------------------------------
    def router(self):
        """The ``KVMosaicRouter`` of this process (None before the first request made it)."""
        return serve_state.get(self.engines.deployment_name)

    def finished(self, routed: dict) -> None:
        router = self.router()
        if router is not None and routed.get("key"):
            router.predicted.pop(routed["key"], None)
            router.finished(routed["key"])

    def observe(self, routed: dict, status: int, usage: dict | None) -> None:
        """The answer to ``routed`` arrived: its replica is no longer loaded by it, and its
        reported ``cached_tokens`` is counted against the router's prediction."""
        router = self.router()
        if router is None or not routed.get("key"):
            return
        router.finished(routed["key"])
        predicted = router.predicted.pop(routed["key"], None)
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        if status == 200 and predicted is not None and cached is not None:
            router.metrics.answered(predicted, cached)

    # ---- replicas, one by one --------------------------------------------------------------
    async def replica_ids(self) -> list[str]:
        """The live replicas (asking one first, if no request has made the router yet), waiting up to 5 s for the
        router to know as many as were started: its view of them fills in after the first requests (the explorer's
        state once showed one replica of two)."""
        if self.router() is None:
            await self.engines.options(method_name="replica_id").remote()
        router = self.router()
        for _ in range(50):
            if router is not None and len(router.curr_replicas) >= (self.args.replicas or 1):
                break
            await asyncio.sleep(0.1)
        return sorted(rid.unique_id for rid in (router.curr_replicas if router is not None else {}))

    async def each_replica(self, method: str, path: str, headers: dict[str, str]) -> dict[str, Answer | None]:
        """The same request to every live replica (None where it failed)."""
        ids = await self.replica_ids()

        async def one(rid: str) -> Answer | None:
            try:
                answer = await asyncio.wait_for(self.ask(method, path, headers, pin=rid), timeout=10)
            except (ReplicaUnavailable, asyncio.TimeoutError, *REPLICA_GONE) as e:
                log.warning("replica %s did not answer %s %s: %r", rid, method, path, e)
                return None
            if answer.replica != rid:
                log.warning("%s %s pinned to replica %s was answered by %s", method, path, rid, answer.replica)
            return answer

        return dict(zip(ids, await asyncio.gather(*(one(r) for r in ids)), strict=True))

    async def router_state(self, pools: bool) -> dict:
        """The router's view: per replica its pid, freshness, gaps and indexed block hashes
        (hex); with ``pools``, also what each replica's pool holds (asked of it, pinned)."""
        router = self.router()
        if router is None:
            return {"router": None, "replicas": {}}
        router.sync(list(router.curr_replicas.values()))  # pids and events, before any request
        with router.follower.lock:
            replicas = {rid: {"pid": router.pids.get(rid), "fresh": router.index.fresh(rid), "gaps": view.gaps,
                              "stale": view.stale, "next_seq": view.next_seq,
                              "index": sorted(h.hex() for h in view.blocks.parent)}
                        for rid, view in router.index.replicas.items()}
        out = {"router": router.policy_name, "replicas": replicas, "pids": dict(router.pids),
               "inflight": dict(router.inflight_requests)}
        if pools:
            out["pools"] = {}
            for rid in list(router.pids):
                try:
                    got_rid, hashes = await self.engines.pool_hashes.remote({"pin": rid})
                except REPLICA_GONE:
                    continue
                if got_rid == rid:
                    out["pools"][rid] = sorted(h.hex() for h in hashes)
        return out

    # ---- drain (called by the driver through the app's handle) ------------------------------
    def begin_drain(self) -> int:
        """Stop admitting generation requests (503); returns how many are in flight."""
        self.drain.draining = True
        return self.drain.in_flight

    def in_flight(self) -> int:
        return self.drain.in_flight

    async def cut_all(self) -> int:
        """The drain deadline: every replica ends its running requests with an error."""
        ids = await self.replica_ids()
        for rid in ids:
            try:
                await self.engines.options(method_name="cut_all").remote({"pin": rid})
            except REPLICA_GONE:
                pass
        return self.drain.in_flight


class ReplicaUnavailable(Exception):
    pass


def last_usage_of_json(body: bytes) -> dict | None:
    try:
        return json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
