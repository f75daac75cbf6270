"""The engine side of the storage tiers: moves KV between the pool and a :class:`TierStack`.

One :class:`TierConnector` per engine (docs/ARCHITECTURE.md, "Storage tiers"), built once by
:func:`make_tier_connector` from the engine's config (None: no tiers, or prefix caching off) and
handed to each user at construction, never attached afterwards. It is

- the pool's observer (``BlockPool(observer=...)``, both backends): on ``cache_block`` it copies the
  block's KV out for the tiers whose policy is write-through; on ``uncache_block(evicted=True)``
  (the KV still in the block) for the write-back tiers. The copy is synchronous (a memcpy, or a
  pinned non-blocking copy plus a sync on CUDA); encoding and the write to a disk or Redis tier
  run on one writer thread, a host tier is written at once;
- the managers' tier lookup (``make_cache_manager(..., tiers=...)``): ``lookup(chain hashes)``;
- the tier I/O under the scheduler's :class:`~.connector.KVConnector`: ``load_now`` (host
  tiers, on the engine thread), ``submit`` / ``collect`` (disk and Redis, on the
  :class:`TierLoader` thread, with a deadline) and ``write_block``. Every payload it hands out
  passed ``TierStack.load``'s checks (checksum, MAC, header, token digest, key, and finite
  values: ``block_io.nonfinite``); a failed or late load is a miss and the scheduler computes
  those tokens;
- the segment store's tier stack (``stack``).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ..cache.events import BlockRemoved, BlockStored, EventLog
from ..tiers import Policy, TierLoader, TierStack, Trigger, build_tiers, load_secret
from .block_io import BlockIO, nonfinite
from .paged import PagedKVCache


class TierConnector:
    def __init__(self, stack: TierStack, io: BlockIO, load_timeout: float = 2.0,
                 events: EventLog | None = None) -> None:
        self.stack = stack
        self.io = io
        # Cache events name each tier as a medium: a block stored there (BlockStored), or
        # dropped by the tier's own eviction or as corrupt (BlockRemoved), so a router can
        # credit a replica per tier.
        self.events = events
        if events is not None:
            for t in stack:
                t.on_removed = functools.partial(self._announce_removed, t.medium)
        self.loader = TierLoader(stack, load_timeout)
        self._writer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmosaic-tier-write")
        self._through = [i for i, t in enumerate(stack) if t.wants(Trigger.FULL)]
        self._back = [i for i, t in enumerate(stack) if t.wants(Trigger.EVICT)]
        self._selective = [i for i, t in enumerate(stack) if t.policy is Policy.WRITE_THROUGH_SELECTIVE]
        # Cached blocks' tokens and parent hash, for a store after the block was cached
        # (write-back, selective).
        self._tokens: dict[bytes, tuple[tuple[int, ...], bytes | None]] = {}
        # Blocks loaded into the pool for the step being scheduled and not indexed yet: chain
        # hash -> source tier (the write-through their indexing triggers skips that tier). The
        # pool indexes one block per hash, so indexing any block under a hash completes every
        # load of it: when two requests loaded the same block in one step, the second commit is
        # a duplicate that never reaches on_cache, and the first one's pop covers both. The
        # scheduler writes a step's loads before that step's commits run, so an entry still here
        # when a later step loads was never indexed (its request failed before committing: the
        # forward pass, a blend or a later write raised); write_block drops those then.
        self._loaded_from: dict[bytes, int] = {}
        self._committed_since_load = False  # on_cache ran since the last write_block
        self._lock = threading.Lock()
        self.hit_tokens = [0] * len(stack)  # tokens each tier supplied to admitted requests
        self.load_failures = 0  # blocks a lookup promised but no tier delivered verified
        self.blocks_loaded = 0
        self.blocks_written = 0
        self.write_errors = 0
        self._closed = False

    @classmethod
    def from_specs(cls, specs: Sequence[str], io: BlockIO, load_timeout: float = 2.0,
                   events: EventLog | None = None, secret: bytes | str | None = None) -> TierConnector:
        """``secret``: the replicas' shared tier secret (every value MAC'd and verified)."""
        return cls(TierStack(build_tiers(list(specs)), secret=secret, payload_check=nonfinite), io, load_timeout,
                   events)

    # ---- the pool's observer ---------------------------------------------------------------
    def on_cache(self, block, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        if self._back or self._selective:
            self._tokens[block_hash] = (tuple(token_ids), parent_hash)
        self._committed_since_load = True
        src = self._loaded_from.pop(block_hash, None)
        targets = [i for i in self._through if i != src]
        if targets:
            self._store(block.block_id, block_hash, parent_hash, token_ids, targets, check=src is not None)

    def on_hit(self, block) -> None:
        """write_through_selective: store a block once it has been hit ``k`` times."""
        targets = [i for i in self._selective if self.stack[i].wants(Trigger.HIT, block.hits)]
        known = self._tokens.get(block.block_hash)
        if targets and known is not None:
            self._store(block.block_id, block.block_hash, known[1], known[0], targets, check=True)

    def on_uncache(self, block, block_hash: bytes, evicted: bool) -> None:
        known = self._tokens.pop(block_hash, None) if (self._back or self._selective) else None
        if not evicted or known is None:
            return
        targets = [i for i in self._back if not (self.stack[i].medium == "host" and self.stack[i].contains(block_hash))]
        if targets:
            self._store(block.block_id, block_hash, known[1], known[0], targets, check=False)

    def _store(self, block_id: int, key: bytes, parent: bytes | None, tokens: Sequence[int], targets: list[int],
               check: bool) -> None:
        payload = self.io.read(block_id)  # now: the block may be overwritten by the next step
        meta = self.io.meta(key, tokens)
        fast = [i for i in targets if self.stack[i].medium == "host"]
        slow = [i for i in targets if i not in fast]
        if fast:
            self._put(key, parent, meta, payload, fast, check)
        if slow and not self._closed:
            self._writer.submit(self._put, key, parent, meta, payload, slow, check)

    def _put(self, key: bytes, parent: bytes | None, meta, payload: bytes, targets: list[int], check: bool) -> None:
        try:
            if check:
                targets = [i for i in targets if not self.stack[i].contains(key)]
            if not targets:
                return
            stored = self.stack.put_block(key, meta, payload, targets)
            with self._lock:
                self.blocks_written += len(stored)
            if self.events is not None:
                for i in stored:
                    self.events.emit(BlockStored([key], parent, list(meta.token_ids), meta.block_size, None,
                                                 self.stack[i].medium))
        except Exception:  # noqa: BLE001 - a failed store is a future miss, never an error
            with self._lock:
                self.write_errors += 1

    def _announce_removed(self, medium: str, key: bytes) -> None:
        self.events.emit(BlockRemoved([key], medium))

    # ---- lookup and load -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        try:
            return self.stack.lookup(keys)
        except Exception:  # noqa: BLE001
            return [None] * len(keys)

    def is_fast(self, tier: int) -> bool:
        return self.stack[tier].medium == "host"

    def load_now(self, keys: Sequence[bytes], tiers: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[bytes]:
        """Load on this thread; the verified payloads of the longest contiguous run."""
        out = []
        for k, t, toks in zip(keys, tiers, tokens):
            try:
                got = self.stack.load(k, self.io.meta(k, toks), t)
            except Exception:  # noqa: BLE001
                got = None
            if got is None:
                self.load_failures += len(keys) - len(out)
                break
            out.append(got.payload)
        return out

    def submit(self, keys: Sequence[bytes], tiers: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[cf.Future]:
        return [self.loader.submit(k, self.io.meta(k, toks), t) for k, t, toks in zip(keys, tiers, tokens)]

    def collect(self, keys: Sequence[bytes], futs: Sequence[cf.Future]) -> dict[bytes, bytes]:
        """Results of finished (or late) loads: the verified payloads, by key."""
        out = {}
        for k, f in zip(keys, futs):
            got = self.loader.result(f)
            if got is None:
                self.load_failures += 1
            else:
                out[k] = got.payload
        return out

    def write_block(self, block_id: int, key: bytes, tier: int, payload: bytes) -> None:
        """Put a loaded payload into a pool block (the manager indexes it at the next commit)."""
        if self._committed_since_load:  # a new step: the last commits indexed all they would
            self._loaded_from.clear()
            self._committed_since_load = False
        self.io.write(block_id, payload)
        self._loaded_from[key] = tier
        self.blocks_loaded += 1

    def record_hit(self, tier: int, num_tokens: int) -> None:
        self.hit_tokens[tier] += num_tokens

    # ---- housekeeping ----------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued write reached its tier."""
        if not self._closed:
            self._writer.submit(lambda: None).result()

    def stats(self) -> dict[str, Any]:
        tiers = self.stack.stats()
        for i, t in enumerate(self.stack):
            tiers[t.name]["hit_tokens"] = self.hit_tokens[i]
        return {
            "tiers": tiers,
            "blocks_loaded": self.blocks_loaded,
            "blocks_written": self.blocks_written,
            "load_failures": self.load_failures,
            "write_errors": self.write_errors,
            "late_loads": self.loader.late_loads,
        }

    def health(self) -> dict[str, str]:
        return {t.name: t.state for t in self.stack}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self.loader.close()
        self.stack.close()


def wait_any(futs: Sequence[cf.Future], until: float) -> None:
    """Block until one of ``futs`` is done or ``until`` (monotonic) passes."""
    cf.wait(futs, timeout=max(0.0, until - time.monotonic()), return_when=cf.FIRST_COMPLETED)


class TierConfig(Protocol):
    """What :func:`make_tier_connector` reads of the engine's config (``EngineConfig``)."""

    kv_tiers: Sequence[str] | None
    kv_tier_load_timeout: float
    kv_tier_secret: str | None
    kv_tier_secret_file: str | None
    prefix_cache: str


def make_tier_connector(config: TierConfig, kv: PagedKVCache, model_fingerprint: str,
                        events: EventLog | None = None) -> TierConnector | None:
    """The engine's one connector, or None when no tiers are configured or prefix caching is
    off (nothing is indexed, so nothing could be stored or found)."""
    if not config.kv_tiers or config.prefix_cache == "none":
        return None
    secret = load_secret(getattr(config, "kv_tier_secret", None), getattr(config, "kv_tier_secret_file", None))
    return TierConnector.from_specs(config.kv_tiers, BlockIO(kv, model_fingerprint), config.kv_tier_load_timeout,
                                    events, secret)

