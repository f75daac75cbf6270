"""A request's block hash chain, computed the way the engine computes it.

Shared code, not a copy: the chain comes from :mod:`kvmosaic.cache.hashing` (the engine's
``HashCacheManager`` uses the same ``BlockHasher``), the seed from ``make_seed`` over the same
model facts, the salt as the server derives it (``TenantPolicy.cache_salt``), and the prompt's
token ids from the tokenizer and chat template the caller passes in (the server's own
``apply_chat_template(..., add_generation_prompt=True)`` then ``encode(add_special_tokens=False)``).
Equality with the engine's hashes is tested (``tests/router/test_prompt_hashes.py``).

Torch-free: the tokenizer is an argument, never imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cache import hashing
from ..cache.hashing import BlockHash, BlockHasher, get_hash_fn, make_seed


def block_hasher(seed: BlockHash, block_size: int, hash_fn, cache_salt: str | None,
                 adapter_id: str | None, public_blocks: int = 0) -> BlockHasher:
    """The engine's ``BlockHasher`` for one namespace (seed, salt, adapter, and the public
    head of shared-public tenancy: ``public_blocks`` leading blocks hashed without the salt)."""
    namespace = getattr(hashing, "CacheNamespace", None)
    if namespace is not None:
        return BlockHasher(namespace(seed, cache_salt, adapter_id, public_blocks), block_size, hash_fn)
    return BlockHasher(seed, block_size, hash_fn, cache_salt, adapter_id)  # before issue 10's namespace


class PromptHasher:
    def __init__(self, seed: BlockHash, block_size: int, hash_algo: str = "sha256_cbor") -> None:
        self.seed, self.block_size, self.hash_algo = seed, block_size, hash_algo
        self.hash_fn = get_hash_fn(hash_algo)

    @classmethod
    def for_model(cls, fingerprint: str, kv_dtype: str, block_size: int, hash_algo: str = "sha256_cbor") -> PromptHasher:
        return cls(make_seed(fingerprint, kv_dtype, block_size, hash_algo), block_size, hash_algo)

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> PromptHasher:
        """From an engine's ``model_info`` (a ``seed`` hex when given, else the model facts)."""
        algo = info.get("hash_algo", "sha256_cbor")
        if info.get("seed"):
            return cls(bytes.fromhex(info["seed"]), int(info["block_size"]), algo)
        return cls.for_model(info["fingerprint"], info["dtype"], int(info["block_size"]), algo)

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None, adapter_id: str | None = None,
               reusable_only: bool = True, public_blocks: int = 0) -> list[BlockHash]:
        """The chain of the prompt's full blocks; with ``reusable_only``, only the blocks a hit
        can cover (the engine always recomputes the last prompt token). ``public_blocks``: as
        the engine's ``Sequence.public_blocks`` (shared-public tenancy)."""
        n = len(token_ids)
        limit = ((n - 1) // self.block_size) * self.block_size if reusable_only and n else n
        return list(block_hasher(self.seed, self.block_size, self.hash_fn, cache_salt, adapter_id, public_blocks)
                    .update(token_ids, limit))


def prompt_token_ids(tokenizer: Any, body: dict[str, Any], chat: bool) -> list[int]:
    """The token ids the server will prefill for an OpenAI request body (one prompt)."""
    from ..server.protocol import ChatCompletionRequest, CompletionRequest

    if chat:
        req = ChatCompletionRequest.model_validate(body)
        text = tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages],
                                             tokenize=False, add_generation_prompt=True)
    else:
        text = CompletionRequest.model_validate(body).single_prompt
    if isinstance(text, str):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(text)
