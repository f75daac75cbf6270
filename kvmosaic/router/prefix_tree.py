"""An approximate prefix tree of routed prompts, as SGLang's gateway and Ray Serve's
``PrefixCacheAffinityRouter`` keep one: it remembers which replica each prompt was sent to,
never what the replica still holds (evictions are invisible to it, hence "approximate").

Keys are chunks of ``chunk`` tokens (or characters, for text), so an insert or a match costs
O(prompt length / chunk) dict operations. Size is bounded: past ``max_nodes`` the least
recently touched leaves are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "replicas", "touched")

    def __init__(self) -> None:
        self.children: dict[tuple, _Node] = {}
        self.replicas: dict[str, int] = {}  # replica -> logical time of the last insert
        self.touched = 0


class PrefixTree:
    def __init__(self, chunk: int = 16, max_nodes: int = 200_000) -> None:
        self.chunk, self.max_nodes = chunk, max_nodes
        self.root = _Node()
        self.num_nodes = 0
        self._clock = 0

    def _chunks(self, seq: Sequence) -> list[tuple]:
        c = self.chunk
        return [tuple(seq[i:i + c]) for i in range(0, len(seq) - len(seq) % c, c)]

    def insert(self, seq: Sequence, replica: str) -> None:
        self._clock += 1
        node = self.root
        for key in self._chunks(seq):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node()
                self.num_nodes += 1
            child.replicas[replica] = self._clock
            child.touched = self._clock
            node = child
        if self.num_nodes > self.max_nodes:
            self._evict(self.max_nodes * 9 // 10)

    def match(self, seq: Sequence, replicas: set[str]) -> dict[str, int]:
        """replica -> matched length (in elements of ``seq``), among ``replicas``."""
        out: dict[str, int] = {}
        node, depth = self.root, 0
        for key in self._chunks(seq):
            node = node.children.get(key)
            if node is None:
                break
            depth += len(key)
            hit = [r for r in node.replicas if r in replicas]
            if not hit:
                break
            for r in hit:
                out[r] = depth
        return out

    def forget(self, replica: str) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.replicas.pop(replica, None)
            stack.extend(node.children.values())

    def _evict(self, target: int) -> None:
        leaves: list[tuple[int, _Node, tuple]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.children:
                    stack.append(child)
                else:
                    leaves.append((child.touched, node, key))
        leaves.sort(key=lambda t: t[0])
        for _, parent, key in leaves[: max(0, self.num_nodes - target)]:
            del parent.children[key]
            self.num_nodes -= 1
