"""One engine replica as a Ray Serve deployment class.

Invariants: the replica's engine publishes every cache event on its own loopback ZeroMQ
endpoint (with replay), named in its routing stats together with an ``instance`` id that
changes when the replica restarts; a request is answered by the single-process server's app
(``server.app.build_app``), so a replica's answer equals ``kvmosaic serve``'s.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import httpx


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


class EngineReplica:
    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from ..engine.config import EngineConfig
        from ..engine.llm_engine import LLMEngine
        from ..server.app import build_app
        from ..server.async_engine import AsyncEngine
        from ..server.events import ZmqEventPublisher
        from ..server.launch import free_port
        from ..server.metrics import ServerMetrics

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.publisher = ZmqEventPublisher(self.events, replay_endpoint=self.replay)
        config = EngineConfig(**{**engine_kwargs, "enable_kv_events": True})
        self.engine = AsyncEngine.launch(lambda: LLMEngine(config), on_flush=self.publisher.publish)
        engine = self.engine.engine
        self.model_name = engine.model_name
        metrics = ServerMetrics(lambda: self.engine.stats, self.model_name)
        self.engine.on_finish = metrics.on_finish
        self.app = build_app(self.engine, self.model_name, metrics)
        self.engine.start()
        self.info = _model_info(engine)
        self.instance = uuid.uuid4().hex
        self.queued_tokens = 0  # prompt tokens of requests in this replica, not yet answered
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://replica",
                                        timeout=None)

    async def handle(self, routed: dict[str, Any]) -> dict[str, Any]:
        """Answer one OpenAI request (``path``, ``body``, ``headers``) through the server app."""
        n = len(routed.get("token_ids") or ())
        self.queued_tokens += n
        try:
            r = await self.client.post(routed["path"], content=routed["body"], headers=routed.get("headers") or {})
        finally:
            self.queued_tokens -= n
        return {"status": r.status_code, "body": r.content, "content_type": r.headers.get("content-type"),
                "replica": self.replica_id()}

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
