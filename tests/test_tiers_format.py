"""The on-tier value format (kvmosaic/tiers/format.py): a value decodes only if it is intact (and,
with a MAC key, authentic) and is the block the caller expects; every failure is a CorruptEntry
with a metrics reason; token ids are stored only as a digest."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmosaic.tiers.format import (
    CHECKSUM_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAC_SIZE,
    MAGIC,
    BlockMeta,
    CorruptEntry,
    TierKeys,
    decode_block,
    decode_block_meta,
    encode_block,
    read_meta,
    tokens_digest,
)

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block tokens, KV heads, head dim


def meta(tokens=(11, 12, 13, 14), key=b"\x01" * 16, **kw) -> BlockMeta:
    base = BlockMeta(fingerprint="smollm2-q4_1:abc", dtype="bfloat16", block_size=4,
                     layout="L,2,B,H,D", shape=SHAPE, token_ids=tuple(tokens), block_hash=key)
    return dataclasses.replace(base, **kw)


PAYLOAD = bytes(range(256)) * 1  # 2*2*4*1*8 elements * 2 bytes = 256


def reason(data, expected) -> str:
    with pytest.raises(CorruptEntry) as e:
        decode_block(data, expected)
    return e.value.reason


def test_round_trip():
    m = meta()
    value = encode_block(m, PAYLOAD)
    assert value.startswith(MAGIC)
    assert decode_block(value, m) == PAYLOAD
    assert decode_block(bytearray(value), m) == PAYLOAD
    # the ids are not in the value: the meta read back has their digest instead
    assert read_meta(value) == dataclasses.replace(m, token_ids=(), tokens_digest=tokens_digest(m.token_ids))
    assert read_meta(value).tokens_digest != tokens_digest(m.token_ids, b"k" * 32)


def test_a_segments_position_and_left_context_digest_come_back_uncompared():
    m = meta(position=40, left=b"\x07" * 16)
    value = encode_block(m, PAYLOAD)
    stored, payload = decode_block_meta(value, meta())  # the expected meta has neither
    assert payload == PAYLOAD and stored.position == 40 and stored.left == b"\x07" * 16
    assert read_meta(encode_block(meta(), PAYLOAD)).left == b""


def test_payload_can_be_a_memoryview():
    m = meta()
    assert decode_block(encode_block(m, memoryview(bytearray(PAYLOAD))), m) == PAYLOAD


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("fingerprint", "other-model", "fingerprint"),
        ("dtype", "float16", "dtype"),
        ("block_size", 8, "block_size"),
        ("layout", "L,B,2,H,D", "layout"),
        ("shape", (2, 2, 4, 2, 4), "layout"),
        ("token_ids", (11, 12, 13, 15), "tokens"),
        ("block_hash", b"\x02" * 16, "key"),
    ],
)
def test_any_meta_mismatch_is_rejected(field, value, why):
    stored = encode_block(meta(), PAYLOAD)
    assert reason(stored, dataclasses.replace(meta(), **{field: value})) == why


def test_payload_size_must_match_shape_and_dtype():
    assert reason(encode_block(meta(), PAYLOAD[:-2]), meta()) == "payload"


def test_unknown_dtype_skips_only_the_size_check():
    m = meta(dtype="custom4")
    assert decode_block(encode_block(m, b"xyz"), m) == b"xyz"


@pytest.mark.parametrize("cut", [0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5, -CHECKSUM_SIZE, -1])
def test_truncation(cut):
    value = encode_block(meta(), PAYLOAD)
    assert reason(value[:cut], meta()) == "truncated"


def test_trailing_bytes():
    assert reason(encode_block(meta(), PAYLOAD) + b"\0", meta()) == "header"


def test_bad_magic_and_version():
    value = bytearray(encode_block(meta(), PAYLOAD))
    assert reason(b"XXXX" + value[4:], meta()) == "header"
    struct.pack_into("<H", value, 4, 99)
    assert reason(value, meta()) == "version"


@pytest.mark.parametrize("where", ["meta", "payload", "checksum"])
def test_flipped_byte_fails_the_checksum(where):
    m = meta()
    value = bytearray(encode_block(m, PAYLOAD))
    pos = {"meta": HEADER_SIZE + 3, "payload": len(value) - CHECKSUM_SIZE - 7, "checksum": len(value) - 1}[where]
    value[pos] ^= 0x40
    assert reason(value, m) == "checksum"


def test_a_valid_entry_with_unreadable_meta_is_a_header_error():
    # a checksum-valid value whose meta is not JSON (a foreign writer): rejected, not crashed
    import xxhash

    body = struct.pack("<4sHHIQ", MAGIC, FORMAT_VERSION, 0, 3, 0) + b"{{{"
    assert reason(body + xxhash.xxh3_128_digest(body), meta()) == "header"


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_is_rejected(pos, bit):
    m = meta()
    value = bytearray(encode_block(m, PAYLOAD))
    value[pos % len(value)] ^= 1 << bit
    with pytest.raises(CorruptEntry):
        decode_block(value, m)


KEYS = TierKeys.from_secret("the replicas' secret")


def test_mac_round_trip_and_a_writer_without_the_key_is_forged():
    m = meta()
    value = encode_block(m, PAYLOAD, KEYS.mac, KEYS.tokens)
    assert decode_block(value, m, KEYS.mac, KEYS.tokens) == PAYLOAD
    assert len(value) == len(encode_block(m, PAYLOAD, None, KEYS.tokens)) + MAC_SIZE
    assert reason(encode_block(m, PAYLOAD, None, KEYS.tokens), m) == "tokens"  # no token key: another digest
    expected = (KEYS.mac, KEYS.tokens)
    for forged in (encode_block(m, PAYLOAD, None, KEYS.tokens),          # no MAC at all
                   encode_block(m, PAYLOAD, b"w" * 32, KEYS.tokens),     # another key
                   encode_block(m, bytes(256), b"w" * 32, KEYS.tokens)):  # other KV, checksum recomputed
        with pytest.raises(CorruptEntry) as e:
            decode_block(forged, m, *expected)
        assert e.value.reason == "forged"
    # the reader without a key (a shared tier, no secret) checks the checksum only
    assert decode_block(value, m, None, KEYS.tokens) == PAYLOAD
    assert "mac" not in repr(KEYS) or KEYS.mac.hex() not in repr(KEYS)


def test_a_byte_flipped_in_the_mac_is_forged():
    m = meta()
    value = bytearray(encode_block(m, PAYLOAD, KEYS.mac, KEYS.tokens))
    value[-1] ^= 1
    with pytest.raises(CorruptEntry) as e:
        decode_block(value, m, KEYS.mac, KEYS.tokens)
    assert e.value.reason == "forged"


def test_no_token_id_is_in_the_value():
    tokens = (70001, 70002, 70003, 70004)
    m = meta(tokens=tokens)
    value = encode_block(m, PAYLOAD, KEYS.mac, KEYS.tokens)
    for t in tokens:
        for width in (4, 8):
            assert t.to_bytes(width, "little") not in value
        assert str(t).encode() not in value


def test_import_is_light():
    """kvmosaic.tiers loads neither torch, transformers nor redis-py (built lazily)."""
    code = (
        "import sys, kvmosaic.tiers, kvmosaic.tiers.redis_server\n"
        "bad = [m for m in ('torch', 'transformers', 'redis', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
