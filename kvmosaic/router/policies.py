"""Routing policies: plain classes with ``choose(request, replicas) -> (replica_id, reason)``.

The same objects run in Ray Serve (``kvmosaic.serve.request_router``) and in the simulator
(``kvmosaic.sim``). A reason is one of ``REASONS``: ``cache_hit`` (chosen for the prompt tokens
it holds), ``load_balance`` (chosen for its load: nothing cached anywhere, every replica past
the load bound, or a policy that only balances) and ``fallback`` (the cache view is stale or
missing, so the policy fell back to least-loaded). A policy never raises for a stale index.

Load is counted in prefill tokens: ``queued_prefill_tokens + running * running_cost_tokens``.
The cache-aware policy picks the replica with the least predicted work before this request's
first token: ``load + uncached prompt tokens``, i.e. cached tokens (credited per tier) are
traded against queued work one for one (``hit_weight`` scales that).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .index import ClusterIndex
from .prefix_tree import PrefixTree
from .prompt_hashes import PromptHasher

REASONS = ("cache_hit", "load_balance", "fallback")
UNHASHED_KEPT = 1024  # prompts routed before the hashing facts arrived, remembered to be expected later


@dataclass
class RouteRequest:
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    adapter_id: str | None = None
    text: str | None = None
    hashes: list[bytes] | None = None  # reusable blocks' chain; computed on demand
    predicted_cached_tokens: int = field(default=0, compare=False)  # set by cache-aware policies


@dataclass
class ReplicaLoad:
    replica_id: str
    queued_prefill_tokens: int = 0
    running: int = 0

    def tokens(self, running_cost_tokens: int) -> int:
        return self.queued_prefill_tokens + self.running * running_cost_tokens


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str, str]:
        return replicas[next(self._next) % len(replicas)].replica_id, "load_balance"


class LeastLoaded:
    name = "least-loaded"

    def __init__(self, running_cost_tokens: int = 16) -> None:
        self.running_cost_tokens = running_cost_tokens
        self._turn = itertools.count()

    def pick(self, replicas: Sequence[ReplicaLoad]) -> str:
        """The least-loaded replica; ties rotate, so an idle cluster is used evenly."""
        start = next(self._turn) % len(replicas)
        order = list(replicas[start:]) + list(replicas[:start])
        return min(order, key=lambda r: r.tokens(self.running_cost_tokens)).replica_id

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str, str]:
        return self.pick(replicas), "load_balance"


class ApproximateTree(LeastLoaded):
    """Route to the replica that was sent the longest prefix of this prompt (by the tree of
    routed prompts), unless the match is short (< ``match_threshold`` of the prompt) or the load
    is imbalanced (max - min > ``imbalance_tokens``): then least-loaded."""

    name = "approximate-tree"

    def __init__(self, match_threshold: float = 0.1, imbalance_tokens: int = 8192, chunk: int = 16,
                 running_cost_tokens: int = 16) -> None:
        super().__init__(running_cost_tokens)
        self.tree = PrefixTree(chunk)
        self.match_threshold, self.imbalance_tokens = match_threshold, imbalance_tokens

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str, str]:
        key = request.text if request.text is not None else request.token_ids
        loads = [r.tokens(self.running_cost_tokens) for r in replicas]
        chosen, reason = None, "load_balance"
        if max(loads) - min(loads) <= self.imbalance_tokens:
            matched = self.tree.match(key, {r.replica_id for r in replicas})
            if matched:
                best = max(matched.values())
                if best >= self.match_threshold * len(key):
                    by_id = {r.replica_id: r for r in replicas}
                    tied = [by_id[r] for r, n in matched.items() if n == best]
                    chosen, reason = min(tied, key=lambda r: r.tokens(self.running_cost_tokens)).replica_id, "cache_hit"
        if chosen is None:
            chosen = self.pick(replicas)
        self.tree.insert(key, chosen)
        return chosen, reason

    def forget(self, replica_id: str) -> None:
        self.tree.forget(replica_id)


class CacheAware(LeastLoaded):
    """Score = load + uncached prompt tokens, from the exact index of replicas' events.

    Degrades, never fails: replicas whose view is stale count as holding nothing; with no fresh
    view at all, or every replica past ``load_bound_tokens``, it is least-loaded. A prompt routed
    before the model's hashing facts are known (``hasher`` None: no replica has reported them yet)
    is remembered with its replica and expected there once :meth:`set_hasher` gives them, so its
    repeats follow it as any other prompt's do.
    """

    name = "cache-aware"

    def __init__(self, index: ClusterIndex, hasher: PromptHasher | None, load_bound_tokens: int = 32768,
                 hit_weight: float = 1.0, expect_ttl_s: float = 30.0, running_cost_tokens: int = 16) -> None:
        super().__init__(running_cost_tokens)
        self.index, self.hasher = index, hasher
        self.load_bound_tokens, self.hit_weight, self.expect_ttl_s = load_bound_tokens, hit_weight, expect_ttl_s
        self._unhashed: deque[tuple[str, RouteRequest, float]] = deque(maxlen=UNHASHED_KEPT)

    def set_hasher(self, hasher: PromptHasher) -> None:
        """The model's hashing facts (a replica's ``model_info``): the prompts routed before them are
        expected where they went, for what is left of their time."""
        self.hasher = hasher
        now = self.index.clock()
        while self._unhashed:
            replica_id, request, routed_at = self._unhashed.popleft()
            left = self.expect_ttl_s - (now - routed_at)
            if left > 0 and self.chain(request):
                self.index.expect(replica_id, request.hashes, left, now)

    def chain(self, request: RouteRequest) -> list[bytes]:
        if request.hashes is None:
            request.hashes = self.hasher.hashes(request.token_ids, request.cache_salt, request.adapter_id)
        return request.hashes

    def held(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> dict[str, tuple[int, float]] | None:
        """replica -> (cached tokens, credited tokens); None when no view can be trusted. A replica
        this router sent the prompt's first block to counts as trusted for it (the expectation is
        the router's own record): a repeat sent before the replica's events arrive finds it."""
        if self.hasher is None and request.hashes is None:
            return None
        chain = self.chain(request)
        trusted = [r.replica_id for r in replicas
                   if self.index.fresh(r.replica_id) or chain and self.index.expects(r.replica_id, chain[0])]
        if not trusted:
            return None
        bs = self.index.block_size
        return {r: (m.blocks * bs, m.credit_tokens) for r, m in self.index.match(chain, trusted).items()}

    def cache_blocks(self, replica_id: str) -> int:
        """How many blocks the index says the replica's cache holds (0 when unknown)."""
        view = self.index.replicas.get(replica_id)
        return len(view.blocks.parent) if view is not None else 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> tuple[str, str]:
        held = self.held(request, replicas)
        cost = self.running_cost_tokens
        if held is None:
            chosen, reason = self.pick(replicas), "fallback"
        elif min(r.tokens(cost) for r in replicas) > self.load_bound_tokens:
            chosen, reason = self.pick(replicas), "load_balance"
        else:
            # Ties (typically: a prompt no replica holds, on an idle cluster) go to the replica
            # whose cache holds the fewest blocks: a new tenant's prefix then lands where it
            # evicts the least, and tenants spread over replicas instead of piling on one.
            n = len(request.token_ids)
            score = {r.replica_id: (r.tokens(cost) + n - self.hit_weight * held.get(r.replica_id, (0, 0.0))[1],
                                    self.cache_blocks(r.replica_id)) for r in replicas}
            start = next(self._turn) % len(replicas)
            order = [r.replica_id for r in replicas[start:]] + [r.replica_id for r in replicas[:start]]
            chosen = min(order, key=score.__getitem__)
            reason = "cache_hit" if held.get(chosen, (0, 0.0))[0] > 0 else "load_balance"
        request.predicted_cached_tokens = held.get(chosen, (0, 0.0))[0] if held else 0
        if request.hashes and self.expect_ttl_s > 0:
            self.index.expect(chosen, request.hashes, self.expect_ttl_s)
        elif self.hasher is None and request.token_ids and self.expect_ttl_s > 0:
            self._unhashed.append((chosen, request, self.index.clock()))
        return chosen, reason


class Oracle(CacheAware):
    """The simulator's ceiling: the same rule, with exact knowledge of every replica's cache
    (including prefixes of requests routed but not yet computed), through ``exact_held``."""

    name = "oracle"

    def __init__(self, exact_held: Callable[[RouteRequest, str], int], load_bound_tokens: int = 32768,
                 running_cost_tokens: int = 16) -> None:
        super().__init__(ClusterIndex(1), None, load_bound_tokens, 1.0, 0.0, running_cost_tokens)
        self.exact_held = exact_held

    def held(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> dict[str, tuple[int, float]]:
        out = {}
        for r in replicas:
            n = self.exact_held(request, r.replica_id)
            if n:
                out[r.replica_id] = (n, float(n))
        return out


POLICIES = ("cache-aware", "round-robin", "least-loaded", "approximate-tree")


def make_policy(name: str, index: ClusterIndex | None = None, hasher: PromptHasher | None = None, **kw):
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded(**kw)
    if name == "approximate-tree":
        return ApproximateTree(**kw)
    if name == "cache-aware":
        if index is None:
            raise ValueError("the cache-aware policy needs a ClusterIndex")
        return CacheAware(index, hasher, **kw)
    raise ValueError(f"unknown router policy {name!r}; choose one of {POLICIES}")
