"""Content names for blocks of KV: the chained block hash.

A full block of ``block_size`` tokens is named by

    H_i = hash(H_{i-1}, tokens_i, extra_keys_i)

with ``H_{-1}`` the *seed*, derived from everything that makes KV incompatible between
engines (model identity, KV dtype, block size). Because each hash folds in its parent, a
block hash names the block's tokens *and* their whole history, so equal hashes mean
reusable KV (up to collisions, which the optional token check guards against).

Extra keys (the cache salt on the first block, an adapter id on every block) taint the
chain, so two tenants or two adapters never share a block.

Hash functions are pluggable, and every one is stable across processes, Python versions and
machines, so hashes can name blocks in a shared tier or be recomputed by a router:

* ``sha256`` (default): SHA-256 over a fixed-width encoding — the parent hash, each token id
  as 8 little-endian bytes, then the extra keys as canonical CBOR when there are any. A full
  block has ``block_size`` tokens (in the seed), so the encoding is unambiguous; no per-block
  CBOR of the tokens makes it ~4x faster than ``sha256_cbor`` (``python -m benchmarks.hashing``);
* ``sha256_cbor``: SHA-256 over canonical CBOR of ``(parent, tokens, extra)``, vLLM's encoding;
* ``xxh3_128``: the fixed-width encoding under xxh3 (not cryptographic: use it where no tenant
  can choose colliding prompts, or with ``verify_tokens``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

BlockHash = bytes
HashFn = Callable[[Any], bytes]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _sha256(obj: Any) -> bytes:
    parent, tokens, extra = obj
    data = parent + _token_bytes(tokens)
    if extra:
        data += cbor2.dumps(extra, canonical=True)
    return hashlib.sha256(data).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh3_128(obj: Any) -> bytes:
    parent, tokens, extra = obj
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(_token_bytes(tokens))
    if extra:
        h.update(cbor2.dumps(extra, canonical=True))
    return h.digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor, "xxh3_128": _xxh3_128}
DEFAULT_HASH_ALGO = "sha256"
# Friendly aliases, as users of vLLM's ``--prefix-caching-hash-algo`` write them.
HASH_ALIASES = {"sha256_cbor_64bit": "sha256_cbor", "xxhash": "xxh3_128"}


def get_hash_fn(name: str) -> HashFn:
    key = HASH_ALIASES.get(name, name)
    if key not in HASH_FUNCTIONS:
        raise ValueError(f"unknown hash_algo {name!r}; choose one of {sorted(HASH_FUNCTIONS)}")
    return HASH_FUNCTIONS[key]


def make_seed(model_fingerprint: str, kv_dtype: str, block_size: int, hash_algo: str) -> BlockHash:
    """``H_{-1}``: two engines share blocks only if all of these agree."""
    return _sha256_cbor(["kvmosaic-seed-v1", model_fingerprint, kv_dtype, block_size, hash_algo])


def hash_block(
    hash_fn: HashFn, parent: BlockHash, tokens: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    return hash_fn((parent, tuple(tokens), tuple(extra_keys)))


@dataclass(frozen=True)
class CacheNamespace:
    """What separates cached KV that must never be shared: the engine's ``seed`` (model,
    KV dtype, block size, hash function), the tenant's ``cache_salt`` and the ``adapter_id``.

    The one home of this fact (docs/ARCHITECTURE.md, invariant 3): the hash chain folds it in
    (:meth:`extra_keys`), the radix tree keys its roots by it, the segment index and the
    scheduler's grouping use it. Two requests may share KV only if their namespaces are equal
    (tests: test_hashing.py, test_radix_tree.py salt isolation, test_tenancy.py).
    """

    seed: BlockHash
    cache_salt: str | None = None
    adapter_id: str | None = None
    # Leading blocks that are public (shared-public tenancy): they are hashed without the
    # salt, so every tenant shares them, and the salt enters at block ``public_blocks``.
    # Carried explicitly from the request (``Sequence.public_blocks``); without a salt there
    # is nothing to keep private, so it is 0 then.
    public_blocks: int = 0

    def __post_init__(self) -> None:
        if self.public_blocks < 0:
            raise ValueError(f"public_blocks must be >= 0, got {self.public_blocks}")
        if self.cache_salt is None and self.public_blocks:
            object.__setattr__(self, "public_blocks", 0)

    def public(self) -> CacheNamespace:
        """The namespace of this one's public blocks: no salt (shared by every tenant)."""
        return CacheNamespace(self.seed, None, self.adapter_id)

    def extra_keys(self, block_index: int) -> tuple:
        """The salt goes into one block only (it taints the rest of the chain through the
        parent hash): the first, or the first after the public prefix; the adapter id goes
        into every block, as vLLM does for LoRA. Without a public prefix, bit-identical to a
        plain salted chain."""
        if self.adapter_id is None and (self.cache_salt is None or block_index != self.public_blocks):
            return ()  # the common case, on the hashing hot path
        keys: list = []
        if block_index == self.public_blocks and self.cache_salt is not None:
            keys.append(("salt", self.cache_salt))
        if self.adapter_id is not None:
            keys.append(("adapter", self.adapter_id))
        return tuple(keys)


class BlockHasher:
    """Extends a sequence's hash chain as its tokens grow; only full blocks are hashed."""

    def __init__(self, namespace: CacheNamespace, block_size: int, hash_fn: HashFn) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.hashes: list[BlockHash] = []

    def update(self, token_ids: Sequence[int], num_tokens: int | None = None) -> list[BlockHash]:
        """Hash every full block of the first ``num_tokens`` (default: all) of ``token_ids``
        not hashed yet; returns the whole chain. Amortised O(new tokens) per call."""
        bs, hashes, hash_fn, ns = self.block_size, self.hashes, self.hash_fn, self.namespace
        n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        parent = hashes[-1] if hashes else ns.seed
        for i in range(len(hashes), n // bs):
            # The same value as hash_block(); tokens go in as a slice (CBOR encodes it alike).
            parent = hash_fn((parent, token_ids[i * bs : (i + 1) * bs], ns.extra_keys(i)))
            hashes.append(parent)
        return hashes
