"""Cache events, shaped like vLLM's KV events so a router can follow what a replica holds.

The block pool appends events to a :class:`EventLog`; a publisher (see ``server/events.py``)
drains it after each engine step. Hashes are the raw block-hash bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: str | None = None
    medium: str = "CPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "CPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventLog:
    """A bounded buffer of events; disabled logs drop everything at no cost."""

    enabled: bool = False
    max_pending: int = 100_000
    pending: list[KVCacheEvent] = field(default_factory=list)

    def emit(self, event: KVCacheEvent) -> None:
        if self.enabled and len(self.pending) < self.max_pending:
            self.pending.append(event)

    def drain(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out
