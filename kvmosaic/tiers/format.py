"""The on-tier value format: one self-checking byte string per KV block.

A value is ``header | meta | payload | checksum``:

- header, fixed 20 bytes, little endian: magic ``b"KVMT"``, format version (u16), flags (u16,
  zero), meta length (u32), payload length (u64);
- meta: UTF-8 JSON of :class:`BlockMeta` (model fingerprint, dtype, block size, layout and shape,
  the block's token ids, and the block's own chain hash);
- payload: the block's KV bytes, laid out as ``meta.layout`` / ``meta.shape`` say;
- checksum: xxh3_128 over everything before it (16 bytes).

Invariant: :func:`decode_block` returns a payload only if every check passes — length, magic,
version, checksum, and each field of the stored meta equal to the one the caller expects (the
chain hash too, so a valid entry copied under another block's key is rejected even when the two
blocks hold the same tokens). Otherwise it raises :class:`CorruptEntry` with a short reason
("truncated", "header", "version", "checksum", "fingerprint", "dtype", "block_size", "layout",
"tokens", "key", "payload") that the tiers count per reason for /metrics. A corrupt entry is a miss
and never reaches attention. Held by tests/test_tiers_format.py.

See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import xxhash

MAGIC = b"KVMT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHIQ")
HEADER_SIZE = _HEADER.size
CHECKSUM_SIZE = 16

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


@dataclass(frozen=True)
class BlockMeta:
    """What a stored block claims to be; a load compares it field by field with the expected one.

    ``layout`` names the payload's axes (e.g. ``"L,2,B,H,D"``: layers, K/V, block tokens, KV heads,
    head dim) and ``shape`` gives their sizes. ``block_hash`` is the chain hash the block is stored
    under (the tier key). ``position`` is where the payload's first token sat when its K was
    rotated (a stored segment's origin; 0 for prefix blocks, whose position follows from the
    chain): a property of the data, not of its identity, so a load reports it and does not compare.
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

    def payload_nbytes(self) -> int | None:
        """The payload size the shape and dtype imply, or None for an unknown dtype."""
        size = DTYPE_SIZES.get(self.dtype)
        return None if size is None else size * math.prod(self.shape)

    def to_json(self) -> bytes:
        d = {
            "fingerprint": self.fingerprint,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layout": self.layout,
            "shape": list(self.shape),
            "token_ids": list(self.token_ids),
            "block_hash": self.block_hash.hex(),
        }
        if self.position:
            d["position"] = self.position
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
            token_ids=tuple(int(x) for x in d["token_ids"]),
            block_hash=bytes.fromhex(d["block_hash"]),
            version=version,
            position=int(d.get("position", 0)),
        )


def encode_block(meta: BlockMeta, payload: bytes | bytearray | memoryview) -> bytes:
    """Serialize one block: header, meta, payload, xxh3_128 checksum over all three."""
    meta_bytes = meta.to_json()
    payload = memoryview(payload).cast("B")
    head = _HEADER.pack(MAGIC, meta.version, 0, len(meta_bytes), payload.nbytes)
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(meta_bytes)
    h.update(payload)
    return b"".join((head, meta_bytes, payload, h.digest()))


def read_meta(data: bytes | bytearray | memoryview) -> BlockMeta:
    """Parse and checksum-verify a value's meta without comparing it to anything."""
    view = memoryview(data).cast("B")
    meta, _ = _parse(view)
    return meta


def decode_block(data: bytes | bytearray | memoryview, expected: BlockMeta) -> bytes:
    """Return the payload of ``data`` if it is intact and is the block ``expected`` describes.

    Raises :class:`CorruptEntry` otherwise (see the module docstring for the reasons).
    """
    return decode_block_meta(data, expected)[1]


def decode_block_meta(data: bytes | bytearray | memoryview, expected: BlockMeta) -> tuple[BlockMeta, bytes]:
    """:func:`decode_block`, with the stored meta (for what a load reports, e.g. ``position``)."""
    view = memoryview(data).cast("B")
    meta, payload = _parse(view)
    for name in ("fingerprint", "dtype", "block_size"):
        if getattr(meta, name) != getattr(expected, name):
            raise CorruptEntry(name, f"stored {getattr(meta, name)!r}, expected {getattr(expected, name)!r}")
    if meta.layout != expected.layout or meta.shape != expected.shape:
        raise CorruptEntry("layout", f"stored {meta.layout} {meta.shape}, expected {expected.layout} {expected.shape}")
    if meta.token_ids != expected.token_ids:
        raise CorruptEntry("tokens")
    if expected.block_hash and meta.block_hash != expected.block_hash:
        raise CorruptEntry("key", "entry belongs to another block")
    want = expected.payload_nbytes()
    if want is not None and payload.nbytes != want:
        raise CorruptEntry("payload", f"{payload.nbytes} bytes, shape implies {want}")
    return meta, payload.tobytes()


def _parse(view: memoryview) -> tuple[BlockMeta, memoryview]:
    if view.nbytes < HEADER_SIZE:
        raise CorruptEntry("truncated", f"{view.nbytes} bytes, header needs {HEADER_SIZE}")
    magic, version, _flags, meta_len, payload_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("header", "bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntry("version", f"format {version}, this build reads {FORMAT_VERSION}")
    total = HEADER_SIZE + meta_len + payload_len + CHECKSUM_SIZE
    if view.nbytes < total:
        raise CorruptEntry("truncated", f"{view.nbytes} of {total} bytes")
    if view.nbytes > total:
        raise CorruptEntry("header", f"{view.nbytes - total} trailing bytes")
    body = view[: total - CHECKSUM_SIZE]
    if xxhash.xxh3_128_digest(body) != view[total - CHECKSUM_SIZE :].tobytes():
        raise CorruptEntry("checksum")
    meta_end = HEADER_SIZE + meta_len
    try:
        meta = BlockMeta.from_json(view[HEADER_SIZE:meta_end].tobytes(), version)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry("header", f"unreadable meta: {e}") from None
    return meta, view[meta_end : meta_end + payload_len]
