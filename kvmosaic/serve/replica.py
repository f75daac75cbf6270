"""One engine replica as a Ray Serve deployment class.

Invariants: a replica runs the single-process server's app, built by the same function from
the same arguments (``server.app.build_server(engine, ServerArgs)``), so its authentication,
tenancy, limits, validation and answers are ``kvmosaic serve``'s; its engine config comes from
the same ``EngineArgs`` (``tests/test_args.py``). Its engine publishes every cache event on its
own ZeroMQ endpoint (with replay; loopback unless ``--ray-address`` joined a cluster; block
hashes only, no token ids), named in its routing stats with an ``instance`` id that changes
when the replica restarts. Answers leave as they are made:
:meth:`EngineReplica.handle` is a generator (the response head with the first body chunk, then
each further chunk).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .asgi import stream_asgi


def _model_info(engine) -> dict[str, Any]:
    info = getattr(engine, "model_info", None)
    if info is not None:
        seed = getattr(info, "seed", b"")
        return {"name": info.name, "fingerprint": info.fingerprint, "dtype": info.dtype,
                "block_size": info.block_size, "hash_algo": info.hash_algo,
                "seed": seed.hex() if isinstance(seed, bytes) else seed}
    c = engine.config
    return {"name": engine.model_name, "fingerprint": engine.model_fingerprint, "dtype": c.dtype,
            "block_size": c.block_size, "hash_algo": c.hash_algo}


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def replica_engine_config(engine_args, server_args):
    """The engine config a replica runs: ``kvmosaic serve``'s (the same ``EngineArgs`` and the
    server's overrides), with torch threads defaulting to the replica's whole CPUs."""
    threads = engine_args.num_threads or max(1, int(server_args.replica_cpus))
    return engine_args.create_engine_config(num_threads=threads, **server_args.engine_overrides())


class EngineReplica:
    def __init__(self, engine_args, server_args) -> None:
        from ..engine.llm_engine import LLMEngine
        from ..server.app import build_server
        from ..server.async_engine import AsyncEngine
        from ..server.events import ZmqEventPublisher
        from ..server.launch import free_port

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Hashes only (the router needs no token ids: it hashes prompts itself), so no tenant's
        # text is on the wire; on a joined cluster the router may be on another host: node's IP.
        host = node_ip() if server_args.ray_address else "127.0.0.1"
        self.events, self.replay = f"tcp://{host}:{free_port()}", f"tcp://{host}:{free_port()}"
        self.publisher = ZmqEventPublisher(self.events, replay_endpoint=self.replay, include_token_ids=False,
                                           allow_remote=host != "127.0.0.1")
        config = replica_engine_config(engine_args, server_args)
        self.engine = AsyncEngine.launch(lambda: LLMEngine(config), on_flush=self.publisher.publish)
        self.model_name = server_args.served_model_name or self.engine.engine.model_name
        self.app = build_server(self.engine, server_args, self.model_name)
        self.engine.start()
        self.info = _model_info(self.engine.engine)
        self.instance = uuid.uuid4().hex
        self.queued_tokens = 0  # prompt tokens of requests in this replica, not yet answered

    async def handle(self, routed: dict[str, Any]) -> AsyncIterator[dict | bytes]:
        """Answer one HTTP request (``method``, ``path``, ``headers``, ``body``) through the
        server app: yields the head ``{"status", "headers", "replica", "first"}`` with the body's
        first chunk in ``first`` (one message to the front, not two, and none while the prefill
        runs), then the other chunks."""
        n = len(routed.get("token_ids") or ())
        self.queued_tokens += n
        head = None
        try:
            async for part in stream_asgi(self.app, routed.get("method", "POST"), routed["path"],
                                          routed.get("headers") or [], routed.get("body") or b""):
                if isinstance(part, dict):
                    head = {**part, "replica": self.replica_id()}
                elif head is not None:  # the head travels with the first chunk: one message, not two
                    yield {**head, "first": part}
                    head = None
                else:
                    yield part
            if head is not None:
                yield head
        finally:
            self.queued_tokens -= n

    def cut_all(self, _routed: dict | None = None) -> str:
        """End every running request with an explicit error (the front's drain deadline)."""
        from ..server.drain import CUT_MESSAGE

        self.engine.cut_all(CUT_MESSAGE, 503, "shutdown")
        return self.replica_id()

    def served_model_name(self, _routed: dict | None = None) -> str:
        return self.model_name

    def replica_id(self) -> str:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id

    def record_routing_stats(self) -> dict[str, Any]:
        st = self.engine.stats
        return {"events": self.events, "replay": self.replay, "instance": self.instance, "ts": time.time(),
                "model_info": self.info, "queued_prefill_tokens": self.queued_tokens,
                "running": st.num_running, "waiting": st.num_waiting, "pid": os.getpid()}

    async def pool_hashes(self, _routed: dict | None = None) -> tuple[str, list[bytes]]:
        """(this replica, what its pool holds now); tests: the router's index must equal it.
        Pass ``{"pin": replica_id}`` to have the router send the call to that replica."""
        return self.replica_id(), await self.engine.call(lambda e: list(e.pool.cached))

    def __del__(self) -> None:  # Ray Serve's replica shutdown hook
        self.engine.shutdown()
        self.publisher.close()
