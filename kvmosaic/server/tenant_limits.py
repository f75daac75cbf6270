"""Per-tenant admission limits: a tenant over its share gets 429, not everyone a slow server.

With API keys, each tenant (a stable, non-reversible label of its key: ``TenantPolicy.
tenant_label``) may have at most ``max_requests`` requests in flight and ``max_queued_tokens``
prompt tokens in flight (admitted, not finished); beyond either, the request is refused with
429 and ``Retry-After`` before it reaches the engine, and counted per tenant
(``kvmosaic:tenant_requests_rejected_total{tenant}``: as many labels as configured keys). The
engine then shares the step budget and slots fairly among what was admitted
(``engine/fair_share.py``). Invariant: every ``admit`` that returned is matched by one
``release`` (the request's stream or response ends, however it ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import APIError

RETRY_AFTER_S = 1


class TenantLimits:
    def __init__(self, max_requests: int | None = None, max_queued_tokens: int | None = None,
                 on_reject: Callable[[str], None] = lambda tenant: None) -> None:
        self.max_requests, self.max_queued_tokens, self.on_reject = max_requests, max_queued_tokens, on_reject
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: str | None, tokens: int) -> None:
        """Count a request of ``tokens`` prompt tokens against ``tenant``; 429 over a limit."""
        if tenant is None:
            return
        with self._lock:
            n, t = self.requests.get(tenant, 0), self.tokens.get(tenant, 0)
            if self.max_requests is not None and n + 1 > self.max_requests:
                why = f"{n} requests in flight (limit {self.max_requests})"
            elif self.max_queued_tokens is not None and n and t + tokens > self.max_queued_tokens:
                why = f"{t} prompt tokens in flight, {tokens} more asked (limit {self.max_queued_tokens})"
            else:
                self.requests[tenant], self.tokens[tenant] = n + 1, t + tokens
                return
        self.on_reject(tenant)
        raise APIError(429, f"this API key has {why}; retry when some finish", code="tenant_limit",
                       headers={"Retry-After": str(RETRY_AFTER_S)})

    def release(self, tenant: str | None, tokens: int) -> None:
        if tenant is None:
            return
        with self._lock:
            self.requests[tenant] = max(0, self.requests.get(tenant, 0) - 1)
            self.tokens[tenant] = max(0, self.tokens.get(tenant, 0) - tokens)
