"""Who is asking, and which cache namespace (salt) their request may use.

* ``api_keys``: when given, every ``/v1`` request must carry ``Authorization: Bearer <key>``
  with one of them (401 otherwise).
* ``salt_secret``: when given, a request's cache salt is derived from its bearer token,
  ``HMAC-SHA256(secret, token)``, and a ``cache_salt`` from the body only subdivides that
  namespace. Since no tenant knows the secret, none can name another tenant's namespace, so
  none can probe (by timing) whether another tenant's prompt is cached. Without a secret the
  body's ``cache_salt`` is used as sent, as vLLM does.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from .errors import APIError


@dataclass
class TenantPolicy:
    api_keys: frozenset[str] = field(default_factory=frozenset)
    salt_secret: bytes | None = None

    def authenticate(self, authorization: str | None) -> str | None:
        """The bearer token (None when absent); raises 401 when keys are required."""
        token = None
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        if self.api_keys and not any(hmac.compare_digest(token or "", k) for k in self.api_keys):
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                           code="invalid_api_key")
        return token

    def cache_salt(self, token: str | None, body_salt: str | None) -> str | None:
        if self.salt_secret is None:
            return body_salt
        tenant = hmac.new(self.salt_secret, (token or "").encode(), hashlib.sha256).hexdigest()[:32]
        return tenant if body_salt is None else f"{tenant}/{body_salt}"
