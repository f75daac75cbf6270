"""A Ray Serve ``RequestRouter`` that runs a ``kvmosaic.router`` policy.

Ray Serve calls ``choose_replicas`` for each request with the live replicas; each replica's
``routing_stats`` (from ``EngineReplica.record_routing_stats``) give its event endpoints,
model facts and pid; load is counted here, from the requests this router sent and the
ingress has not yet seen answered (``finished``), as stats arrive up to a period late.
The router follows every replica's events into its ``ClusterIndex`` (``EventFollower``),
forgets replicas Ray Serve removed or saw die, and returns the policy's choice first, then the
other replicas by load (Ray Serve tries them in order if one is full).

Invariants: a decision never raises for missing stats or events (it degrades to least-loaded,
reason ``fallback``); the router registers itself in ``kvmosaic.serve.state`` under its
deployment's name, so the ingress in the same process (the handle owner) can report accuracy
and serve /metrics. Not a global of this module: Ray Serve pickles this module's router class
*by value*, so this module's globals are private copies in the ingress process (see ``state``).

A request whose first argument is ``{"pin": replica_id}`` goes to that replica when it is live
(admin and test calls: ``EngineReplica.pool_hashes``, ``info``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from ..router.follower import EventFollower
from ..router.index import ClusterIndex
from ..router.metrics import RouterMetrics
from ..router.policies import (
    ApproximateTree,
    CacheAware,
    ReplicaLoad,
    RouteRequest,
    make_policy,
)
from ..router.prompt_hashes import PromptHasher
from . import state as serve_state  # a module: pickled by reference, so one registry per process

log = logging.getLogger("kvmosaic.router")
MAX_PENDING_PREDICTIONS = 100_000  # predictions never matched by a reported answer are dropped


class KVMosaicRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **policy_kwargs: Any) -> None:
        self.policy_name = policy
        self.index = ClusterIndex(16)
        self.follower = EventFollower(self.index)
        self.policy = make_policy(policy, index=self.index, **policy_kwargs)
        self.metrics = RouterMetrics(policy)
        # Load, counted here: prefill tokens (uncached, as predicted) and requests this router
        # sent and the ingress has not yet seen answered. Exact and current for the traffic of
        # this ingress, unlike replicas' routing stats, which arrive through the controller
        # up to a period late (a request that just finished would still count against its
        # replica and push its tenant's next request away from the cache).
        self._inflight: dict[str, tuple[str, int]] = {}  # request key -> (replica, tokens)
        self.inflight_tokens: dict[str, int] = {}
        self.inflight_requests: dict[str, int] = {}
        self.predicted: dict[str, int] = {}  # request key -> predicted cached tokens
        self.pids: dict[str, int] = {}  # replica -> its process id (from its routing stats)
        serve_state.register(self._deployment_id.name, self)

    # ---- membership ----------------------------------------------------------------------
    def sync(self, replicas: list[RunningReplica]) -> None:
        """Learn the replicas' pids and event endpoints from their routing stats."""
        for r in replicas:
            st = r.routing_stats or {}
            rid = r.replica_id.unique_id
            if "pid" in st:
                self.pids[rid] = st["pid"]
            if "events" in st:
                if isinstance(self.policy, CacheAware) and self.policy.hasher is None:
                    hasher = PromptHasher.from_model_info(st["model_info"])
                    with self.follower.lock:  # the index is written under it
                        self.index.block_size = hasher.block_size
                        self.policy.set_hasher(hasher)
                self.follower.add(rid, st["events"], st.get("replay"), st.get("instance"))

    def _drop(self, rid: str) -> None:
        self.follower.remove(rid)
        self.pids.pop(rid, None)
        self.inflight_tokens.pop(rid, None)
        self.inflight_requests.pop(rid, None)
        if isinstance(self.policy, ApproximateTree):
            self.policy.forget(rid)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in self.follower.replicas() - live:
            self._drop(rid)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id.unique_id)

    def finished(self, key: str) -> None:
        """The ingress got an answer (or an error) for request ``key``: it no longer loads its replica."""
        got = self._inflight.pop(key, None)
        if got is not None:
            rid, tokens = got
            self.inflight_tokens[rid] = max(0, self.inflight_tokens.get(rid, 0) - tokens)
            self.inflight_requests[rid] = max(0, self.inflight_requests.get(rid, 0) - 1)

    # ---- decisions -----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self.sync(candidate_replicas)
        routed = pending_request.args[0] if pending_request is not None and pending_request.args else {}
        if not isinstance(routed, dict):
            routed = {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pin = routed.get("pin")
        if pin in by_id:
            return [[by_id[pin]]]
        loads = [ReplicaLoad(rid, self.inflight_tokens.get(rid, 0), self.inflight_requests.get(rid, 0))
                 for rid in by_id]
        req = RouteRequest(str(routed.get("key", "")), list(routed.get("token_ids") or []), routed.get("cache_salt"))
        t0 = time.perf_counter()
        with self.follower.lock:
            try:
                chosen, reason = self.policy.choose(req, loads)
            except Exception:
                log.exception("routing policy failed; least-loaded instead")
                chosen, reason = min(loads, key=lambda x: x.queued_prefill_tokens).replica_id, "fallback"
        self.metrics.decided(reason, time.perf_counter() - t0)
        self.metrics.observe_index(self.index)
        if req.request_id:
            if len(self.predicted) >= MAX_PENDING_PREDICTIONS:
                self.predicted.pop(next(iter(self.predicted)))
            self.predicted[req.request_id] = req.predicted_cached_tokens
        if req.request_id:
            self.finished(req.request_id)  # a request routed again (its replica refused or died)
            self._inflight[req.request_id] = (chosen, len(req.token_ids) - req.predicted_cached_tokens)
            self.inflight_tokens[chosen] = self.inflight_tokens.get(chosen, 0) + self._inflight[req.request_id][1]
            self.inflight_requests[chosen] = self.inflight_requests.get(chosen, 0) + 1
        rest = sorted((x for x in loads if x.replica_id != chosen), key=lambda x: x.queued_prefill_tokens)
        return [[by_id[chosen]]] + [[by_id[x.replica_id]] for x in rest]
