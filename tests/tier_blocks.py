"""Small stored blocks for the storage-tier tests: a key, a header and a payload per integer."""

from __future__ import annotations

from kvmosaic.tiers import BlockMeta, encode_block


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def meta(i: int, n: int = 64, fingerprint: str = "model-a") -> BlockMeta:
    return BlockMeta(fingerprint=fingerprint, dtype="uint8", block_size=4, layout="N", shape=(n,),
                     token_ids=(i, i + 1, i + 2, i + 3), block_hash=key(i))


def payload(i: int, n: int = 64) -> bytes:
    return bytes([i % 251]) * n


def value(i: int, n: int = 64) -> bytes:
    return encode_block(meta(i, n), payload(i, n))
