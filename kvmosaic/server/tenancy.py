"""Who is asking, what they may do, and which cache namespace (salt) their request uses.

A shared prefix cache is a side channel: a hit answers faster (time to first token) and
``usage.prompt_tokens_details.cached_tokens`` counts it, so a caller who may hit another
tenant's blocks can test whether that tenant sent a given text. The tenancy mode decides
what may be shared:

* ``isolated`` (the default whenever the server knows tenants: API keys or a salt secret):
  each tenant's salt is ``HMAC-SHA256(secret, bearer token)``; the secret is generated at
  start when not given. No block is shared across tenants, so nothing leaks; a ``cache_salt``
  in the body only subdivides the tenant's own namespace.
* ``shared`` (no tenants known): one namespace, as vLLM without ``cache_salt``; a body
  ``cache_salt`` is used as sent. For one trusted user: every caller can probe every prompt.
* ``shared-public``: as ``isolated``, except that a *public* prefix is hashed without the
  salt and so shared by every tenant; the salt enters at the first block after it (the
  count travels as ``ProcessedPrompt.public_blocks`` into ``cache.hashing.CacheNamespace``).
  A prefix is public when the operator registered it (``--public-prefix-file``: texts, or
  chain hashes ``sha256:<hex>`` of the last public block) or the request marks it
  (``public_prefix``: the first N chat messages, or the first N characters / token ids of a
  completion prompt). Only whole blocks are public.
  A caller can learn that a public text is cached, and nothing about anyone's private text.

No ``LLM(tenancy=...)``: the offline API has one caller, the process that owns the engine, its
memory and its cache, and no credentials to tell tenants apart; there is no one to isolate from.
A program that serves several users through ``LLM`` passes a per-user ``cache_salt`` (each
prompt may carry its own, ``{"prompt": ..., "cache_salt": ...}``), which is what ``isolated``
does from API keys; the timing and ``cached_tokens`` side channels exist only where untrusted
callers share a server, which is what ``kvmosaic serve --tenancy`` governs.

Admin surface: with keys configured, ``/reset_prefix_cache``, ``/metrics`` and the detailed
``/health`` need an admin key (401 without a valid credential, 403 with a tenant key); a
tenant cannot reset its own namespace alone (the hash index does not record namespaces), so
it gets 403 with that reason. Every malformed credential is a 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import APIError

log = logging.getLogger(__name__)

TENANCY_MODES = ("isolated", "shared", "shared-public")


def _bearer(authorization: str | None, strict: bool = True) -> str | None:
    """The bearer token of an Authorization header; 401 on a malformed one (non-ASCII or
    control characters, empty token, another scheme) when ``strict`` (keys configured),
    else None (anonymous)."""
    if authorization is None:
        return None
    if not strict:
        try:
            return _bearer(authorization)
        except APIError:
            return None
    if not authorization.isascii() or not authorization.isprintable() or authorization[:7].lower() != "bearer ":
        raise APIError(401, "malformed credentials (expected Authorization: Bearer <key>)", code="invalid_api_key")
    token = authorization[7:].strip()
    if not token:
        raise APIError(401, "malformed credentials (empty bearer token)", code="invalid_api_key")
    return token


def _member(token: str | None, keys: frozenset[str]) -> bool:
    found = False
    if token is None:
        return False
    tb = token.encode()
    for k in keys:  # compare against all (constant time per key, no early exit)
        found |= hmac.compare_digest(tb, k.encode())
    return found


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PublicPrefixes:
    """Operator-registered public prefixes: token runs (from texts) and chain hashes of the
    last block of a public prefix (``chain`` computes a prompt's unsalted chain)."""

    block_size: int
    token_runs: list[list[int]] = field(default_factory=list)
    hashes: frozenset[bytes] = frozenset()
    chain: Callable[[Sequence[int]], list[bytes]] | None = None

    def blocks(self, token_ids: Sequence[int], marked: Sequence[int] | None = None) -> int:
        """How many leading full blocks of ``token_ids`` are public."""
        best = 0
        for run in [*self.token_runs, *([marked] if marked else [])]:
            best = max(best, common_prefix(token_ids, run))
        n = best // self.block_size
        if self.hashes and self.chain is not None:
            for i, h in enumerate(self.chain(token_ids)):
                if h in self.hashes:
                    n = max(n, i + 1)
        return n


def read_public_prefix_file(path: str) -> tuple[list[str], list[bytes]]:
    """Texts separated by lines holding only ``---``; a line ``sha256:<hex>`` (or
    ``hash:<hex>``) registers a chain hash instead."""
    texts, hashes, cur = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f.read().split("\n"):
            s = line.strip()
            if s == "---":
                texts.append("\n".join(cur))
                cur = []
            elif s.startswith(("sha256:", "hash:")) and not cur:
                hashes.append(bytes.fromhex(s.split(":", 1)[1]))
            else:
                cur.append(line)
    if "\n".join(cur).strip():
        texts.append("\n".join(cur).rstrip("\n"))
    return [t for t in texts if t.strip()], hashes


@dataclass
class TenantPolicy:
    api_keys: frozenset[str] = field(default_factory=frozenset)
    salt_secret: bytes | None = None
    mode: str | None = None  # None: isolated when tenants are known, else shared
    admin_keys: frozenset[str] = field(default_factory=frozenset)
    public: PublicPrefixes | None = None

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "isolated" if (self.api_keys or self.salt_secret is not None) else "shared"
        if self.mode not in TENANCY_MODES:
            raise ValueError(f"unknown tenancy mode {self.mode!r}; choose one of {TENANCY_MODES}")
        if self.mode != "shared" and self.salt_secret is None:
            self.salt_secret = os.urandom(32)  # per process: salts change on restart (cold cache)
        if set(self.api_keys) & set(self.admin_keys):
            raise ValueError("an admin key must not also be a tenant key")
        self._label_key = os.urandom(32)

    @property
    def keys_configured(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    # ---- credentials ---------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """The bearer token (None when absent); raises 401 when keys are required and the
        token is not one of them, and on any malformed credential."""
        token = _bearer(authorization, self.keys_configured)
        if self.api_keys and not (_member(token, self.api_keys) or _member(token, self.admin_keys)):
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                           code="invalid_api_key")
        return token

    def role(self, authorization: str | None) -> str:
        """``admin`` | ``tenant`` | ``anonymous`` (no credential); 401 on a bad one."""
        token = _bearer(authorization)
        if token is None:
            return "anonymous"
        if _member(token, self.admin_keys):
            return "admin"
        if _member(token, self.api_keys) or not self.api_keys:
            return "tenant"
        raise APIError(401, "invalid API key", code="invalid_api_key")

    def require_admin(self, authorization: str | None, what: str) -> None:
        """Open when no key is configured; else 401 without a valid credential, 403 for a
        tenant key."""
        if not self.keys_configured:
            return
        role = self.role(authorization)
        if role == "admin":
            return
        if role == "anonymous":
            raise APIError(401, f"{what} needs the admin key (Authorization: Bearer <admin key>)",
                           code="invalid_api_key")
        raise APIError(403, f"{what} needs the admin key; a tenant key may not call it", code="forbidden")

    def is_admin(self, authorization: str | None) -> bool:
        if not self.keys_configured:
            return True
        try:
            return self.role(authorization) == "admin"
        except APIError:
            return False

    # ---- namespaces ----------------------------------------------------------------------
    def tenant_salt(self, token: str | None) -> str:
        return hmac.new(self.salt_secret or b"", (token or "").encode(), hashlib.sha256).hexdigest()[:32]

    def tenant_label(self, token: str | None) -> str | None:
        """Who sent a request, for fair share and per-tenant limits and metrics: a stable,
        non-reversible label of the API key (None without keys: one shared class)."""
        if not self.api_keys or token is None:
            return None
        key = self.salt_secret or self._label_key
        return "t-" + hmac.new(key, b"tenant-label\0" + token.encode(), hashlib.sha256).hexdigest()[:12]

    def cache_salt(self, token: str | None, body_salt: str | None) -> str | None:
        if self.mode == "shared":
            return body_salt
        tenant = self.tenant_salt(token)
        return tenant if body_salt is None else f"{tenant}/{body_salt}"

    def public_blocks(self, token_ids: Sequence[int], marked: Sequence[int] | None = None) -> int:
        if self.mode != "shared-public":
            return 0
        if self.public is None:
            return 0
        return self.public.blocks(token_ids, marked)

    async def resolve(self, engine, req, prompt, salt: str | None):
        """The prompt and salt to queue. In ``shared-public`` mode the prompt is tokenised
        here (off the event loop) to find its public head, and the processed prompt carries
        the salt and how many leading blocks are public (``public_blocks``); otherwise both
        are returned unchanged."""
        if self.mode != "shared-public":
            return prompt, salt
        return await asyncio.to_thread(self._resolve_sync, engine, req, prompt, salt)

    def _resolve_sync(self, engine, req, prompt, salt):
        from dataclasses import replace

        processed = engine.inputs.process(prompt, None, req.truncate_prompt_tokens)  # public only if still the head
        marked = self._marked_tokens(engine, req, prompt)
        n = self.public_blocks(processed.prompt_token_ids, marked)
        return replace(processed, cache_salt=salt, public_blocks=n), None

    @staticmethod
    def _marked_tokens(engine, req, prompt) -> list[int] | None:
        k = getattr(req, "public_prefix", None)
        if not k:
            return None
        try:
            messages = getattr(req, "messages", None)
            if messages is not None:
                text = engine.tokenizer.apply_chat_template([m.as_template_dict() for m in messages[:k]],
                                                            tokenize=False, add_generation_prompt=False)
                return engine.inputs.process(text, None).prompt_token_ids
            if isinstance(prompt, str):
                return engine.inputs.process(prompt[:k], None).prompt_token_ids
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt[:k])
        except (ValueError, TypeError):
            return None
        return None


def build_public_prefixes(engine, texts: Sequence[str], hashes: Sequence[bytes]) -> PublicPrefixes:
    """Tokenise registered texts as prompts (and as a chat system message, so a chat whose
    system prompt is the text shares it); ``engine`` is an :class:`LLMEngine`."""
    runs: list[list[int]] = []
    for text in texts:
        for candidate in (text, _system_rendering(engine, text)):
            if candidate:
                try:
                    runs.append(engine.inputs.process(candidate, None).prompt_token_ids)
                except ValueError as e:
                    log.warning("public prefix ignored: %s", e)

    def chain(ids: Sequence[int]) -> list[bytes]:
        return list(engine.cache.new_hasher().update(list(ids)))

    return PublicPrefixes(engine.config.block_size, runs, frozenset(hashes), chain)


def _system_rendering(engine, text: str) -> str | None:
    try:
        return engine.tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False,
                                                    add_generation_prompt=False)
    except Exception:  # templates without a system role
        return None
