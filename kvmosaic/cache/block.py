"""The bookkeeping of one physical KV block, and the intrusive queue that links free blocks.

A leaf module: the pool, the evictors and the radix tree all build on it; it imports only
the hash type. The tensors a block stands for live in ``kv/``; see
docs/ARCHITECTURE.md for which structure owns which state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .hashing import BlockHash


class KVBlock:
    """Bookkeeping for one physical block of the KV pool (the tensors live in ``kv/``).

    ``last_access``, ``hits`` and ``priority`` feed the eviction policy: the pool's logical
    clock at the last reference taken or dropped, the references taken since the block was
    (re)filled, and the highest priority of a request that dropped a reference to it.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free",
                 "last_access", "hits", "priority", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept only when tokens are verified
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.last_access = 0
        self.hits = 0
        self.priority = 0
        self.group = 0  # the KV layer group (cache/kv_groups.py) whose content the block holds

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


class FreeBlockQueue:
    """Doubly linked list through the blocks themselves: O(1) push at either end, pop from
    the head and removal from the middle (a cache hit on an evictable block)."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise IndexError("no free block")
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free
