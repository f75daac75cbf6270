"""The on-tier value format: one self-checking, optionally authenticated byte string per KV block.

A value is ``header | meta | payload | checksum [| mac]``:

- header, fixed 20 bytes, little endian: magic ``b"KVMT"``, format version (u16), flags (u16:
  bit 0 = a MAC follows the checksum), meta length (u32), payload length (u64);
- meta: UTF-8 JSON of :class:`BlockMeta` (model fingerprint, dtype, block size, layout and shape,
  a digest of the block's token ids (never the ids themselves), and the block's own chain hash);
- payload: the block's KV bytes, laid out as ``meta.layout`` / ``meta.shape`` say;
- checksum: xxh3_128 over everything before it (16 bytes): catches accidents;
- mac (flag bit 0): HMAC-SHA256 over header, meta and payload (32 bytes) under the tier's MAC
  key (``--kv-tier-secret``, shared by the replicas; a per-process random key for host tiers
  without one): catches writers. A reader that has a MAC key accepts only values whose MAC
  verifies (constant-time compare); one without (disk and Redis with no secret) checks the
  checksum only: such tiers trust every writer (a warning is logged when the stack is built).

Token ids: the meta carries ``tokens`` = BLAKE2b-128 of the ids (int64 little endian), keyed by
a key derived from the secret when there is one (unkeyed otherwise: no more than the chain hash,
the value's key, already reveals); the loader recomputes it from the request's tokens.

Invariant: :func:`decode_block` returns a payload only if every check passes — length, magic,
version, checksum, MAC (when the reader has a key), and each field of the stored meta equal to
the one the caller expects (the chain hash too, so a valid entry copied under another block's key
is rejected even when the two blocks hold the same tokens). Otherwise it raises
:class:`CorruptEntry` with a short reason ("truncated", "header", "version", "checksum",
"forged", "fingerprint", "dtype", "block_size", "layout", "tokens", "key", "payload"; the stack
adds "nonfinite") that the tiers count per reason for /metrics. A corrupt entry is a miss and
never reaches attention. Held by tests/test_tiers_format.py and tests/test_tiers_auth.py.

See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

MAGIC = b"KVMT"
#: 2: token ids replaced by a digest, optional MAC (1: ids in clear, checksum only). Any other
#: version is a miss (reason "version"), never an error.
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHIQ")
HEADER_SIZE = _HEADER.size
CHECKSUM_SIZE = 16
MAC_SIZE = 32
FLAG_MAC = 1
TOKENS_DIGEST_SIZE = 16

#: Bytes per element of the dtypes whose payload size the decoder can check against the shape.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


class CorruptEntry(ValueError):
    """A stored value failed a check; ``reason`` names which one (a metrics label)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# -- keys --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierKeys:
    """The keys derived from the shared secret: ``mac`` (HMAC-SHA256 of values) and ``tokens``
    (keys the token digest). Built with :meth:`from_secret`; ``repr`` shows neither."""

    mac: bytes = field(repr=False)
    tokens: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes | str) -> TierKeys:
        if isinstance(secret, str):
            secret = secret.encode()
        if not secret:
            raise ValueError("the tier secret is empty")
        derive = lambda label: hmac.new(secret, b"kvmosaic tier " + label, hashlib.sha256).digest()  # noqa: E731
        return cls(derive(b"mac v2"), derive(b"tokens v2"))


def load_secret(secret: str | bytes | None = None, secret_file: str | None = None) -> bytes | None:
    """The secret from ``--kv-tier-secret`` or ``--kv-tier-secret-file`` (the file's bytes,
    trailing whitespace stripped); None when neither is set. Both, or an empty one: ValueError."""
    if secret is not None and secret_file is not None:
        raise ValueError("give kv_tier_secret or kv_tier_secret_file, not both")
    if secret_file is not None:
        secret = Path(secret_file).read_bytes().rstrip()
        if not secret:
            raise ValueError(f"kv_tier_secret_file {secret_file!r} is empty")
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ValueError("kv_tier_secret is empty")
    return secret


def tokens_digest(token_ids: Sequence[int], key: bytes | None = None) -> bytes:
    """BLAKE2b-128 of the ids as int64 little endian, keyed by ``key`` (the secret's) if given."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(data, digest_size=TOKENS_DIGEST_SIZE, key=key or b"", person=b"kvmosaic-tokens").digest()


def _mac(key: bytes, body: memoryview) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


@dataclass(frozen=True)
class BlockMeta:
    """What a stored block claims to be; a load compares it field by field with the expected one.

    ``layout`` names the payload's axes (e.g. ``"L,2,B,H,D"``: layers, K/V, block tokens, KV heads,
    head dim) and ``shape`` gives their sizes. ``block_hash`` is the chain hash the block is stored
    under (the tier key). ``position`` is where the payload's first token sat when its K was
    rotated (a stored segment's origin; 0 for prefix blocks, whose position follows from the
    chain): a property of the data, not of its identity, so a load reports it and does not compare.

    ``left`` (segments only) is the digest of the tokens the payload was computed after
    (:func:`tokens_digest` under the token key), reported like ``position``, never compared.

    ``token_ids`` is what the caller knows (expected side, and what a store announces in events);
    it is never written: the value holds ``tokens_digest`` instead, so a meta read back from a
    value (:func:`read_meta`) has ``token_ids == ()`` and the digest.
    """

    fingerprint: str
    dtype: str
    block_size: int
    layout: str
    shape: tuple[int, ...]
    token_ids: tuple[int, ...]
    block_hash: bytes = b""
    version: int = field(default=FORMAT_VERSION)
    position: int = 0
    tokens_digest: bytes = b""
    left: bytes = b""

    def payload_nbytes(self) -> int | None:
        """The payload size the shape and dtype imply, or None for an unknown dtype."""
        size = DTYPE_SIZES.get(self.dtype)
        return None if size is None else size * math.prod(self.shape)

    def digest(self, token_key: bytes | None = None) -> bytes:
        """The token digest this meta stands for (computed from ``token_ids`` when it has them)."""
        if self.token_ids or not self.tokens_digest:
            return tokens_digest(self.token_ids, token_key)
        return self.tokens_digest

    def to_json(self, token_key: bytes | None = None) -> bytes:
        d = {
            "fingerprint": self.fingerprint,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layout": self.layout,
            "shape": list(self.shape),
            "tokens": self.digest(token_key).hex(),
            "block_hash": self.block_hash.hex(),
        }
        if self.position:
            d["position"] = self.position
        if self.left:
            d["left"] = self.left.hex()
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, version: int) -> BlockMeta:
        d = json.loads(data)
        return cls(
            fingerprint=str(d["fingerprint"]),
            dtype=str(d["dtype"]),
            block_size=int(d["block_size"]),
            layout=str(d["layout"]),
            shape=tuple(int(x) for x in d["shape"]),
            token_ids=(),
            block_hash=bytes.fromhex(d["block_hash"]),
            version=version,
            position=int(d.get("position", 0)),
            tokens_digest=bytes.fromhex(d["tokens"]),
            left=bytes.fromhex(d.get("left", "")),
        )


def encode_block(meta: BlockMeta, payload: bytes | bytearray | memoryview, mac_key: bytes | None = None,
                 token_key: bytes | None = None) -> bytes:
    """Serialize one block: header, meta (the token digest under ``token_key``), payload, xxh3_128
    checksum over all three, and with ``mac_key`` an HMAC-SHA256 over the same three."""
    meta_bytes = meta.to_json(token_key)
    payload = memoryview(payload).cast("B")
    flags = FLAG_MAC if mac_key is not None else 0
    head = _HEADER.pack(MAGIC, meta.version, flags, len(meta_bytes), payload.nbytes)
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(meta_bytes)
    h.update(payload)
    parts = [head, meta_bytes, payload, h.digest()]
    if mac_key is not None:
        m = hmac.new(mac_key, head, hashlib.sha256)
        m.update(meta_bytes)
        m.update(payload)
        parts.append(m.digest())
    return b"".join(parts)


def read_meta(data: bytes | bytearray | memoryview, mac_key: bytes | None = None) -> BlockMeta:
    """Parse and verify (checksum; MAC with ``mac_key``) a value's meta without comparing it."""
    view = memoryview(data).cast("B")
    meta, _ = _parse(view, mac_key)
    return meta


def decode_block(data: bytes | bytearray | memoryview, expected: BlockMeta, mac_key: bytes | None = None,
                 token_key: bytes | None = None) -> bytes:
    """Return the payload of ``data`` if it is intact and is the block ``expected`` describes.

    Raises :class:`CorruptEntry` otherwise (see the module docstring for the reasons).
    """
    return decode_block_meta(data, expected, mac_key, token_key)[1]


def decode_block_meta(data: bytes | bytearray | memoryview, expected: BlockMeta, mac_key: bytes | None = None,
                      token_key: bytes | None = None) -> tuple[BlockMeta, bytes]:
    """:func:`decode_block`, with the stored meta (for what a load reports, e.g. ``position``)."""
    view = memoryview(data).cast("B")
    meta, payload = _parse(view, mac_key)
    for name in ("fingerprint", "dtype", "block_size"):
        if getattr(meta, name) != getattr(expected, name):
            raise CorruptEntry(name, f"stored {getattr(meta, name)!r}, expected {getattr(expected, name)!r}")
    if meta.layout != expected.layout or meta.shape != expected.shape:
        raise CorruptEntry("layout", f"stored {meta.layout} {meta.shape}, expected {expected.layout} {expected.shape}")
    if not hmac.compare_digest(meta.tokens_digest, expected.digest(token_key)):
        raise CorruptEntry("tokens")
    if expected.block_hash and meta.block_hash != expected.block_hash:
        raise CorruptEntry("key", "entry belongs to another block")
    want = expected.payload_nbytes()
    if want is not None and payload.nbytes != want:
        raise CorruptEntry("payload", f"{payload.nbytes} bytes, shape implies {want}")
    return meta, payload.tobytes()


def _parse(view: memoryview, mac_key: bytes | None = None) -> tuple[BlockMeta, memoryview]:
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry("truncated", f"{view.nbytes} bytes, header needs {HEADER_SIZE}")
    magic, version, flags, meta_len, payload_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("header", "bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntry("version", f"format {version}, this build reads {FORMAT_VERSION}")
    if flags & ~FLAG_MAC:
        raise CorruptEntry("header", f"unknown flags {flags:#x}")
    body_len = HEADER_SIZE + meta_len + payload_len
    total = body_len + CHECKSUM_SIZE + (MAC_SIZE if flags & FLAG_MAC else 0)
    if view.nbytes < total:
        raise CorruptEntry("truncated", f"{view.nbytes} of {total} bytes")
    if view.nbytes > total:
        raise CorruptEntry("header", f"{view.nbytes - total} trailing bytes")
    body = view[:body_len]
    if xxhash.xxh3_128_digest(body) != view[body_len : body_len + CHECKSUM_SIZE].tobytes():
        raise CorruptEntry("checksum")
    if mac_key is not None:
        if not flags & FLAG_MAC:
            raise CorruptEntry("forged", "no MAC")
        if not hmac.compare_digest(_mac(mac_key, body), view[total - MAC_SIZE : total].tobytes()):
            raise CorruptEntry("forged", "MAC mismatch")
    meta_end = HEADER_SIZE + meta_len
    try:
        meta = BlockMeta.from_json(view[HEADER_SIZE:meta_end].tobytes(), version)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry("header", f"unreadable meta: {e}") from None
    return meta, view[meta_end : meta_end + payload_len]
