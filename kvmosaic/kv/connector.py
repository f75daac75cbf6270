"""The scheduler's side of the storage tiers: vLLM's ``KVConnectorBase_V1`` (scheduler role).

docs/ARCHITECTURE.md, "Storage tiers". The scheduler owns one :class:`KVConnector` (None when
no tiers are configured or prefix caching is off) and does no tier I/O itself; it asks:

1. :meth:`KVConnector.get_num_new_matched_tokens` ``(seq, match) -> (tokens, load_async)``: how
   many tokens past the pool's match the tiers supply. A host tier loads now, on the engine
   thread; disk and Redis load on the background loader and the answer is ``(0, True)``: the
   request waits in ``WAITING_FOR_KV`` off the queue until :meth:`get_finished` names it;
2. :meth:`KVConnector.update_state_after_alloc` ``(seq, block_ids, num_external_tokens)``: the
   blocks are allocated; the loaded payloads go into them (indexed at the step's commit);
3. :meth:`KVConnector.request_finished` ``(seq, block_ids)``: on finish or abort, pending loads
   are cancelled and held payloads dropped. Write-through needs nothing here: the pool's
   observer (:class:`~.tiered.TierConnector`) copied each block out when it was cached, so the
   blocks may be freed at once;

plus :meth:`KVConnector.get_finished` once a step while requests wait for KV.

Invariants: every payload written into a block passed ``TierStack.load``'s checks; the tokens
reported are exactly those written (a failed or late load shortens the contiguous run and
those tokens are computed); an exception raised by a question belongs to the one request it
was asked about (the scheduler fails that request alone, tests: test_fault_isolation.py);
per-request state lives from the question to admission or finish, never longer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..cache.manager import MatchResult
from .tiered import wait_any


@dataclass
class _Pending:
    """Payloads loaded for a request's admission being decided: they go into blocks
    ``first .. first + len(payloads) - 1`` of its table; ``hits`` are ``(key, tier)``."""

    first: int
    hits: list[tuple[bytes, int]]
    payloads: list[bytes]


class KVConnector:
    """Scheduler-side connector over the engine's tier I/O (``tiers``: a
    :class:`~.tiered.TierConnector`, or anything with its ``is_fast``, ``load_now``,
    ``submit``, ``collect``, ``write_block`` and ``record_hit``)."""

    def __init__(self, tiers: Any, block_size: int) -> None:
        self.tiers = tiers
        self.block_size = block_size
        self._loading: dict[str, tuple[list[bytes], list]] = {}  # request id -> (keys, futures)
        self._loaded: dict[str, dict[bytes, bytes]] = {}  # finished background loads, by key
        self._pending: dict[str, _Pending] = {}

    # ---- the three questions -------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq, match: MatchResult) -> tuple[int, bool]:
        """Tokens past ``match.num_tokens`` the tiers supply (the longest contiguous run of
        ``match.tier_hits`` that loaded verified), and whether they load asynchronously
        (then 0 now: ask again once :meth:`get_finished` named the request). Raises when a
        load raises: that request fails alone."""
        rid, bs = seq.request_id, self.block_size
        self._pending.pop(rid, None)
        if not match.tier_hits:
            return 0, False
        first = match.num_tokens // bs
        keys = [h for h, _ in match.tier_hits]
        have = self._loaded.get(rid)
        if have is not None:  # loaded in the background already
            payloads = []
            for k in keys:
                if k not in have:
                    break
                payloads.append(have[k])
        else:
            tiers = [t for _, t in match.tier_hits]
            tokens = [seq.all_token_ids[(first + j) * bs : (first + j + 1) * bs] for j in range(len(keys))]
            if not all(self.tiers.is_fast(t) for t in tiers):
                self._loading[rid] = (keys, self.tiers.submit(keys, tiers, tokens))
                return 0, True
            payloads = self.tiers.load_now(keys, tiers, tokens)
        self._pending[rid] = _Pending(first, list(match.tier_hits[: len(payloads)]), payloads)
        return len(payloads) * bs, False

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated ``block_ids`` (the request's table) for the tokens the last
        :meth:`get_num_new_matched_tokens` reported: write the loaded payloads into them.
        Raises when a write raises (the request fails alone; its blocks stay unindexed)."""
        rid = seq.request_id
        self._loaded.pop(rid, None)
        pending = self._pending.pop(rid, None)
        if pending is None or not num_external_tokens:
            return
        for j, payload in enumerate(pending.payloads):
            key, tier = pending.hits[j]
            self.tiers.write_block(block_ids[pending.first + j], key, tier, payload)
            self.tiers.record_hit(tier, self.block_size)

    def request_finished(self, seq, block_ids: list[int]) -> None:
        """The request finished or was aborted: cancel its loads and drop what it held. The
        blocks may be freed at once (write-through already copied them at ``cache_block``)."""
        rid = seq.request_id
        self._pending.pop(rid, None)
        self._loaded.pop(rid, None)
        keys_futs = self._loading.pop(rid, None)
        if keys_futs is not None:
            for f in keys_futs[1]:
                f.cancel()

    # ---- once a step -----------------------------------------------------------------------
    def get_finished(self, wait: bool = False) -> list[tuple[str, BaseException | None]]:
        """Requests whose background loads all finished or passed their deadline, in the order
        they were submitted: ``(request id, None)`` when ready to be asked again,
        ``(request id, exception)`` when collecting raised. ``wait``: nothing else to run, so
        block until a load finishes or the earliest deadline passes instead of spinning."""
        if not self._loading:
            return []
        if wait:
            futs = [f for _, fs in self._loading.values() for f in fs if not f.done()]
            if futs:
                wait_any(futs, min(f.deadline for f in futs))
        now = time.monotonic()
        out: list[tuple[str, BaseException | None]] = []
        for rid, (keys, futs) in list(self._loading.items()):
            if all(f.done() or now > f.deadline for f in futs):
                del self._loading[rid]
                try:
                    self._loaded[rid] = self.tiers.collect(keys, futs)
                except Exception as exc:  # noqa: BLE001 - this request alone fails
                    out.append((rid, exc))
                    continue
                out.append((rid, None))
        return out

    @property
    def num_loading(self) -> int:
        return len(self._loading)
