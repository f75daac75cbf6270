"""Content names for blocks of KV: the chained block hash.

A full block of ``block_size`` tokens is named by

    H_i = hash(H_{i-1}, tokens_i, extra_keys_i)

with ``H_{-1}`` the *seed*, derived from everything that makes KV incompatible between
engines (model identity, KV dtype, block size). Because each hash folds in its parent, a
block hash names the block's tokens *and* their whole history, so equal hashes mean
reusable KV (up to collisions, which the optional token check guards against).

Extra keys (the cache salt on the first block, an adapter id on every block) taint the
chain, so two tenants or two adapters never share a block.

Hash functions are pluggable: ``sha256_cbor`` (default) hashes a canonical CBOR encoding
and is stable across processes, Python versions and machines, so hashes can name blocks in
a shared tier; ``xxh3_128`` is several times faster and equally stable across processes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

BlockHash = bytes
HashFn = Callable[[Any], bytes]


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh3_128(obj: Any) -> bytes:
    parent, tokens, extra = obj
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(cbor2.dumps(extra, canonical=True))
    return h.digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256_cbor": _sha256_cbor, "xxh3_128": _xxh3_128}
# Friendly aliases, as users of vLLM's ``--prefix-caching-hash-algo`` write them.
HASH_ALIASES = {"sha256": "sha256_cbor", "sha256_cbor_64bit": "sha256_cbor", "xxhash": "xxh3_128"}


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

    The one home of this fact: the hash chain folds it in (:meth:`extra_keys`), the radix
    tree keys its roots by it, the segment index and the scheduler's grouping use it. Two
    requests may share KV only if their namespaces are equal (tests: test_hashing.py,
    test_radix_tree.py salt isolation).
    """

    seed: BlockHash
    cache_salt: str | None = None
    adapter_id: str | None = None

    def extra_keys(self, block_index: int) -> tuple:
        """The salt goes into the first block only (it taints the rest of the chain through
        the parent hash); the adapter id goes into every block, as vLLM does for LoRA."""
        keys: list = []
        if block_index == 0 and self.cache_salt is not None:
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
        bs = self.block_size
        n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        for i in range(len(self.hashes), n // bs):
            parent = self.hashes[-1] if self.hashes else self.namespace.seed
            extra = self.namespace.extra_keys(i)
            self.hashes.append(hash_block(self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra))
        return self.hashes
