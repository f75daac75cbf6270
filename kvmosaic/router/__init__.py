"""Routing across replicas: which replica should prefill this prompt?

Torch-free by contract (a test imports it in a fresh interpreter and finds neither torch nor
transformers): the router runs in an ingress process, a Ray Serve router or the simulator.

* ``index``: block hash -> replicas holding it (and on which medium), fed by each replica's
  cache event batches, with gap, restart and death handling;
* ``prompt_hashes``: a request's chain hashes, computed with the engine's own hashing code;
* ``policies``: round-robin, least-loaded, approximate-tree, cache-aware and an oracle, each a
  plain class with ``choose(request, replicas) -> (replica_id, reason)``; the same objects run
  inside Ray Serve (``kvmosaic.serve``) and the simulator (``kvmosaic.sim``);
* ``metrics``: the router's Prometheus metrics;
* ``follower``: a thread that subscribes to replicas' ZeroMQ event streams and feeds the index.
"""

from .index import ClusterIndex, Match
from .policies import (
    POLICIES,
    ApproximateTree,
    CacheAware,
    LeastLoaded,
    Oracle,
    ReplicaLoad,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from .prompt_hashes import PromptHasher

__all__ = ["POLICIES", "ApproximateTree", "CacheAware", "ClusterIndex", "LeastLoaded", "Match", "Oracle",
           "PromptHasher", "ReplicaLoad", "RoundRobin", "RouteRequest", "make_policy"]
