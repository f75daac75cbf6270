"""The block pool: reference counts, the content index and an O(1) LRU free queue.

Invariants (checked by :meth:`BlockPool.check_invariants`, property-tested):

* every block is in exactly one state: *in use* (``ref_cnt > 0``), *evictable*
  (``ref_cnt == 0`` and it holds a hash, so its KV can still be hit), or *free*
  (``ref_cnt == 0``, no hash); ``free + evictable + in_use == num_blocks``;
* the free queue holds exactly the blocks with ``ref_cnt == 0``; blocks without a hash sit
  before all cached ones, so a cached block is evicted only when no truly free block is left;
  among cached blocks the order is least recently freed first;
* a block's hash is set only after its KV was written (the caller's promise) and cleared
  only when the block is evicted (re-allocated) or the cache is reset;
* a block with a reference is never evicted; a hash maps to at most one block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog
from .hashing import BlockHash


class KVBlock:
    """Bookkeeping for one physical block of the KV pool (the tensors live in ``kv/``)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept only when tokens are verified
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


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


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Owns every block's reference count and the hash -> block index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog | None = None,
        verify_tokens: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events = events or EventLog()
        self.verify_tokens = verify_tokens
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free plus evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int] | None = None
    ) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is not None and self.verify_tokens and token_ids is not None:
            if block.token_ids != tuple(token_ids):
                return None  # a hash collision: treat as a miss, never serve wrong KV
        return block

    # ---- reference counting --------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting cached ones lazily."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (removing them from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Pass them in eviction order: a request frees
        its blocks tail first, so its last blocks (least likely shared) are evicted first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # ---- the content index ---------------------------------------------------------------
    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        adapter_id: str | None = None,
    ) -> bool:
        """Index a full block whose KV has been written. Returns False (and indexes nothing)
        when another block already holds this hash: the first copy stays canonical."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        if self.verify_tokens:
            block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        self.events.emit(
            BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, adapter_id)
        )
        return True

    def _evict(self, block: KVBlock) -> None:
        del self.cached[block.block_hash]
        self.events.emit(BlockRemoved([block.block_hash]))
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (returns False) while any block is in use,
        since running requests may be about to index blocks they are filling."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.free_queue = FreeBlockQueue(self.blocks)
        self.events.emit(AllBlocksCleared())
        return True

    def check_invariants(self) -> None:
        in_queue = set()
        for b in self.free_queue:
            assert b.ref_cnt == 0, f"{b} is queued with references"
            assert b.block_id not in in_queue, f"{b} is queued twice"
            in_queue.add(b.block_id)
        seen_cached = False
        for b in self.free_queue:
            if b.block_hash is not None:
                seen_cached = True
            assert not (seen_cached and b.block_hash is None), "a free block sits behind a cached one"
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"{b} queue state is wrong"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"{b} hash not indexed"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        free = sum(b.ref_cnt == 0 and b.block_hash is None for b in self.blocks)
        evictable = sum(b.ref_cnt == 0 and b.block_hash is not None for b in self.blocks)
        in_use = sum(b.ref_cnt > 0 for b in self.blocks)
        assert free + evictable + in_use == self.num_blocks
