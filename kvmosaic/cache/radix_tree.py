"""A radix tree of token runs over the paged block pool (SGLang's RadixAttention, paged).

Each :class:`~kvmosaic.cache.hashing.CacheNamespace` has its own root, so two tenants or two
adapters never share a node, exactly as their hash chains never share a block.

Full blocks are also named by their chain hash, so a router or a storage tier sees the radix
backend exactly as it sees the hash backend: when a node is created or grown, every block
whose *last* position it now covers is indexed in the pool (:meth:`BlockPool.cache_block`,
one ``BlockStored``); when a leaf is evicted, those blocks leave the index
(:meth:`BlockPool.uncache_block`, one ``BlockRemoved`` and one eviction each). Splits move no
block's last position, so they change nothing there.

Invariants (checked by :meth:`RadixTree.check_invariants`, property-tested):

* a node's ``key`` is a non-empty run of tokens (roots have none), ``start`` is its parent's
  ``end`` and its children start with distinct tokens;
* a node holds one pool reference on each block covering one of its positions:
  ``blocks[i]`` is block index ``start // B + i`` of the path, ``len(blocks) ==
  ceil(end / B) - start // B``. When a node boundary falls inside a block, both nodes hold
  that block. A node's blocks hold valid KV for every path position of those blocks up to
  ``end``, so the deepest node reaching a block index gives the block to reuse;
* ``lock_ref`` counts holders (running requests, pins) of the node or of a descendant: a
  holder locks a node and all its ancestors, so ``lock_ref >= sum of children's``. A node
  with ``lock_ref > 0`` is never evicted, and neither is any block it covers;
* ``evictable_size`` and ``protected_size`` are the tokens in unlocked and locked nodes,
  kept incrementally by :meth:`lock` / :meth:`unlock` / insert / split / evict;
* only unlocked leaves are evicted (leaf first: a parent becomes a candidate once its last
  child is gone), in the order of the eviction policy; a leaf longer than needed loses only
  its tail blocks (it is split at a block boundary), so eviction is as fine-grained as the
  hash backend's.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .block import KVBlock
from .block_pool import BlockPool
from .eviction import order_key
from .hashing import BlockHash, CacheNamespace


class RadixNode:
    __slots__ = ("key", "start", "blocks", "children", "parent", "lock_ref",
                 "last_access", "hits", "priority", "namespace")

    def __init__(self, key: list[int], start: int, parent: RadixNode | None, namespace: CacheNamespace) -> None:
        self.key = key
        self.start = start
        self.blocks: list[KVBlock] = []
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.priority = 0
        self.namespace = namespace

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode([{self.start}, {self.end}), lock={self.lock_ref}, children={len(self.children)})"


@dataclass
class TreeMatch:
    """The longest cached prefix: ``blocks`` hold the KV of its ``num_tokens`` tokens (the
    last one only partly when ``num_tokens % B``); ``node`` is the deepest node reached
    (it may extend past the match) — lock it to keep the match alive."""

    node: RadixNode | None
    num_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)


@dataclass
class EvictResult:
    num_blocks_freed: int = 0
    num_tokens: int = 0
    num_nodes: int = 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    if type(a) is not type(b):  # slices of a list and a tuple never compare equal
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slices (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class RadixTree:
    def __init__(self, pool: BlockPool, policy: str = "lru") -> None:
        order_key(policy, 0, 0, 0)  # validates the name
        self.pool = pool
        self.bs = pool.block_size
        self.policy = policy
        self.roots: dict[CacheNamespace, RadixNode] = {}
        self.evictable_size = 0
        self.protected_size = 0
        self.num_evicted_tokens = 0
        self._clock = itertools.count(1)

    # ---- lookup --------------------------------------------------------------------------
    def match(self, namespace: CacheNamespace, tokens: Sequence[int]) -> TreeMatch:
        """Longest prefix of ``tokens`` in the tree. No side effects."""
        node = self.roots.get(namespace)
        if node is None:
            return TreeMatch(None)
        tokens = tokens if isinstance(tokens, list) else list(tokens)  # list == tuple is False
        table: list[KVBlock] = []
        pos, n, bs = 0, len(tokens), self.bs
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            c = common_prefix_len(child.key, tokens[pos : pos + len(child.key)])
            reach = child.start + c
            first = child.start // bs
            del table[first:]  # the deeper node's block wins where both cover one
            table.extend(child.blocks[: _ceil_div(reach, bs) - first])
            node, pos = child, reach
            if c < len(child.key):
                break
        return TreeMatch(node, pos, table)

    # ---- insertion -----------------------------------------------------------------------
    def insert(
        self,
        namespace: CacheNamespace,
        tokens: Sequence[int],
        blocks: Sequence[KVBlock],
        from_node: RadixNode | None = None,
        owner: RadixNode | None = None,
        priority: int = 0,
        block_hashes: Sequence[BlockHash] = (),
    ) -> RadixNode:
        """Make ``tokens`` (whose KV the request's ``blocks`` hold) a path of the tree and
        return the deepest node reached (it may extend past ``tokens``). The walk starts at
        ``from_node`` (its path must be a prefix of ``tokens``). Existing nodes keep their
        blocks (the first copy stays canonical); new nodes reference the request's blocks.
        ``owner`` is the node the caller alone holds locked: if it is the leaf where the walk
        ends and its last block is the request's, it grows in place instead of chaining
        one-token children (the decode case). New tokens get the request's ``priority``.
        ``block_hashes`` is the chain of ``tokens``' full blocks; the blocks the new tokens
        complete are indexed under it (see the module docstring)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        node = from_node or self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = RadixNode([], 0, None, namespace)
        pos, n = node.end, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                if node is owner and self._can_extend(node, blocks):
                    self._extend(node, tokens[pos:n], blocks, priority)
                else:
                    node = self._add_leaf(node, tokens[pos:n], blocks, priority)
                self._index_full_blocks(node, pos, n, tokens, block_hashes)
                return node
            c = common_prefix_len(child.key, tokens[pos : pos + len(child.key)])
            if c < len(child.key) and pos + c < n:
                child = self._split(child, c)
            node, pos = child, pos + c
            if pos >= n:
                break
        return node

    def _index_full_blocks(
        self, node: RadixNode, lo: int, hi: int, tokens: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Index the blocks of ``node`` whose last position is in ``[lo, hi)``, new to the tree."""
        bs, first = self.bs, node.start // self.bs
        for i in range(lo // bs, min(hi // bs, len(hashes))):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(node.blocks[i - first], hashes[i], parent, tokens[i * bs : (i + 1) * bs],
                                  node.namespace.adapter_id)

    def _can_extend(self, node: RadixNode, blocks: Sequence[KVBlock]) -> bool:
        if node.is_root or node.children or node.lock_ref != 1:
            return False
        if node.end % self.bs == 0:
            return True
        idx = (node.end - 1) // self.bs
        return idx < len(blocks) and node.blocks[-1] is blocks[idx]

    def _extend(self, node: RadixNode, run: Sequence[int], blocks: Sequence[KVBlock], priority: int) -> None:
        old_end = node.end
        node.key.extend(run)
        new = list(blocks[_ceil_div(old_end, self.bs) : _ceil_div(node.end, self.bs)])
        self.pool.touch(new)
        node.blocks.extend(new)
        node.last_access = next(self._clock)
        node.priority = max(node.priority, priority)
        if node.lock_ref:
            self.protected_size += len(run)
        else:
            self.evictable_size += len(run)

    def _add_leaf(
        self, parent: RadixNode, run: Sequence[int], blocks: Sequence[KVBlock], priority: int
    ) -> RadixNode:
        leaf = RadixNode(list(run), parent.end, parent, parent.namespace)
        leaf.blocks = list(blocks[leaf.start // self.bs : _ceil_div(leaf.end, self.bs)])
        if len(leaf.blocks) != _ceil_div(leaf.end, self.bs) - leaf.start // self.bs:
            raise ValueError("the request's blocks do not cover the tokens to insert")
        self.pool.touch(leaf.blocks)
        leaf.last_access = next(self._clock)
        leaf.hits = 1
        leaf.priority = priority
        parent.children[run[0]] = leaf
        self.evictable_size += len(run)
        return leaf

    def _split(self, child: RadixNode, c: int) -> RadixNode:
        """Cut ``child`` after its first ``c`` tokens. The new node is the *parent* part, so
        ``child`` keeps its identity, end and lock (holders stay valid)."""
        bs = self.bs
        mid = RadixNode(child.key[:c], child.start, child.parent, child.namespace)
        cut = child.start + c
        first = child.start // bs
        mid.blocks = child.blocks[: _ceil_div(cut, bs) - first]
        child.blocks = child.blocks[cut // bs - first :]
        if cut % bs:
            self.pool.touch([child.blocks[0]])  # the block across the cut: both hold it
        mid.lock_ref, mid.last_access, mid.hits, mid.priority = (
            child.lock_ref, child.last_access, child.hits, child.priority)
        child.parent.children[child.key[0]] = mid
        child.key = child.key[c:]
        child.start = cut
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    # ---- locks and usage -----------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def touch_path(self, node: RadixNode, priority: int = 0, hit: bool = True) -> None:
        """Record a use of the path to ``node`` (for the eviction policy): a new hit when a
        request starts on it, a refresh of recency (``hit=False``) when one ends."""
        now = next(self._clock)
        while node is not None and not node.is_root:
            node.last_access = now
            node.hits += hit
            node.priority = max(node.priority, priority)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------
    def _key(self, node: RadixNode) -> tuple[int, ...]:
        return order_key(self.policy, node.last_access, node.hits, node.priority)

    def evict(self, num_blocks: int) -> EvictResult:
        """Evict unlocked leaves, victims first, until ``num_blocks`` blocks went back to the
        pool or nothing evictable is left."""
        res = EvictResult()
        if num_blocks <= 0:
            return res
        heap = [(self._key(n), id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        free_before = self.pool.num_free_blocks
        while heap and self.pool.num_free_blocks - free_before < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent.children.get(leaf.key[0]) is not leaf or not self._evictable_leaf(leaf):
                continue  # removed already: pushed twice (a split head that then lost its tail)
            still = num_blocks - (self.pool.num_free_blocks - free_before)
            cut = (_ceil_div(leaf.end, self.bs) - still) * self.bs
            if cut > leaf.start:
                # Evict only the tail blocks needed, as the hash backend evicts block by
                # block: the head keeps serving hits. The cut is block-aligned: no shared block.
                head = self._split(leaf, cut - leaf.start)
                heapq.heappush(heap, (self._key(head), id(head), head))
            parent = leaf.parent
            self._remove_leaf(leaf)
            res.num_nodes += 1
            res.num_tokens += len(leaf.key)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (self._key(parent), id(parent), parent))
        res.num_blocks_freed = self.pool.num_free_blocks - free_before
        self.num_evicted_tokens += res.num_tokens
        return res

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return not node.is_root and not node.children and node.lock_ref == 0

    def _remove_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        first = leaf.start // self.bs
        for i in range(leaf.start // self.bs, leaf.end // self.bs):  # blocks ending in the leaf
            block = leaf.blocks[i - first]
            if block.block_hash is not None:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(leaf.blocks), leaf.priority)
        self.evictable_size -= len(leaf.key)
        leaf.blocks = []
        if parent.is_root and not parent.children:
            del self.roots[parent.namespace]

    def clear(self) -> bool:
        """Drop every node. Refused (False) while any node is locked."""
        if self.protected_size or any(r.lock_ref for r in self._nodes()):
            return False
        for node in list(self._nodes()):
            if not node.is_root:
                self.pool.free_blocks(reversed(node.blocks), node.priority)
                node.blocks = []
        self.roots.clear()
        self.evictable_size = 0
        return True

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- checks and sizes ----------------------------------------------------------------
    def block_refs(self) -> tuple[dict[int, int], set[int]]:
        """Per block id: the references the tree holds, and the blocks a locked node covers."""
        refs: dict[int, int] = {}
        locked: set[int] = set()
        for node in self._nodes():
            for b in node.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
                if node.lock_ref:
                    locked.add(b.block_id)
        return refs, locked

    def check_invariants(self) -> None:
        bs = self.bs
        evictable = protected = 0
        for node in self._nodes():
            if node.is_root:
                assert not node.key and node.start == 0 and not node.blocks
                assert node.children, "an empty root was kept"
                assert self.roots.get(node.namespace) is node
                continue
            assert node.key, f"{node} is empty"
            assert node.start == node.parent.end
            assert node.parent.children.get(node.key[0]) is node
            assert len(node.blocks) == _ceil_div(node.end, bs) - node.start // bs, f"{node} blocks"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node} locks"
            for b in node.blocks:
                assert b.ref_cnt > 0, f"{node} covers unreferenced {b}"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), "sizes drifted"
        refs, _ = self.block_refs()
        for bid, r in refs.items():
            assert self.pool.blocks[bid].ref_cnt >= r, f"block {bid} has fewer refs than the tree holds"
