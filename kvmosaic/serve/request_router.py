"""A Ray Serve ``RequestRouter`` that runs a ``kvmosaic.router`` policy.

Ray Serve calls ``choose_replicas`` for each request with the live replicas; each replica's
``routing_stats`` (from ``EngineReplica.record_routing_stats``) give its event endpoints,
model facts and load. The router follows every replica's events into its ``ClusterIndex``
(``EventFollower``), forgets replicas Ray Serve removed or saw die, and returns the policy's
choice first, then the other replicas by load (Ray Serve tries them in order if one is full).

Invariants: a decision never raises for missing stats or events (it degrades to least-loaded,
reason ``fallback``); one router state per process (``STATE``), so the ingress in the same
process can report accuracy and serve /metrics.
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

log = logging.getLogger("kvmosaic.router")
STATE: dict[str, Any] = {}  # "router": the KVMosaicRouter of this process


class KVMosaicRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "cache-aware", **policy_kwargs: Any) -> None:
        self.policy_name = policy
        self.index = ClusterIndex(16)
        self.follower = EventFollower(self.index)
        self.policy = make_policy(policy, index=self.index, **policy_kwargs)
        self.metrics = RouterMetrics(policy)
        self.routed_since: dict[str, int] = {}  # tokens routed since the replica's last stats
        self.stats_ts: dict[str, float] = {}
        self.predicted: dict[str, int] = {}  # request key -> predicted cached tokens
        STATE["router"] = self

    # ---- membership ----------------------------------------------------------------------
    def _sync(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            st = r.routing_stats or {}
            rid = r.replica_id.unique_id
            if st.get("ts") != self.stats_ts.get(rid):
                self.stats_ts[rid] = st.get("ts")
                self.routed_since[rid] = 0
            if "events" in st:
                if isinstance(self.policy, CacheAware) and self.policy.hasher is None:
                    self.policy.hasher = PromptHasher.from_model_info(st["model_info"])
                    self.index.block_size = self.policy.hasher.block_size
                self.follower.add(rid, st["events"], st.get("replay"), st.get("instance"))

    def _drop(self, rid: str) -> None:
        self.follower.remove(rid)
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

    # ---- decisions -----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._sync(candidate_replicas)
        routed = pending_request.args[0] if pending_request is not None and pending_request.args else {}
        if not isinstance(routed, dict):
            routed = {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = []
        for rid, r in by_id.items():
            st = r.routing_stats or {}
            loads.append(ReplicaLoad(rid, int(st.get("queued_prefill_tokens", 0)) + self.routed_since.get(rid, 0),
                                     int(st.get("running", 0))))
        req = RouteRequest(str(routed.get("key", "")), list(routed.get("token_ids") or []), routed.get("cache_salt"))
        t0 = time.perf_counter()
        with self.follower.lock:
            try:
                chosen, reason = self.policy.choose(req, loads)
            except Exception:
                log.exception("routing policy failed; least-loaded instead")
                chosen, reason = min(loads, key=lambda x: x.queued_prefill_tokens).replica_id, "fallback"
        self.metrics.decided(reason, time.perf_counter() - t0, req.predicted_cached_tokens)
        self.metrics.observe_index(self.index)
        if req.request_id:
            self.predicted[req.request_id] = req.predicted_cached_tokens
        self.routed_since[chosen] = self.routed_since.get(chosen, 0) + len(req.token_ids)
        rest = sorted((x for x in loads if x.replica_id != chosen), key=lambda x: x.queued_prefill_tokens)
        return [[by_id[chosen]]] + [[by_id[x.replica_id]] for x in rest]
