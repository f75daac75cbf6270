"""Shared tiers trust no writer (issue 25, item 4), against a real redis-server (no fakes).

- a forged entry (valid format, recomputed checksum, no MAC or a wrong one) is never served: it is
  counted ("forged"), deleted, and the engine's output equals the no-cache reference;
- a payload with NaN under a valid MAC is rejected ("nonfinite"), counted, deleted, and the
  request succeeds with the reference output;
- no token id of a prompt appears in any Redis value (a keyed digest stands in for them);
- a disk tier whose directory is deleted, or a Redis whose server goes away, says so: ``state``
  leaves "up" with the error, logged once at WARNING, and the recovery is logged once too;
- the secret comes from ``--kv-tier-secret`` or ``--kv-tier-secret-file`` and is never printed.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import uuid

import numpy as np
import pytest

from kvmosaic import SamplingParams
from kvmosaic.engine.arg_utils import EngineArgs
from kvmosaic.tiers import BlockMeta, DiskTier, HostTier, TierKeys, TierStack, encode_block, load_secret, read_meta
from kvmosaic.tiers.format import HEADER_SIZE
from kvmosaic.tiers.redis_server import RedisServer, find_redis_server
from tests.conftest import make_llm

redis = pytest.importorskip("redis", reason="the 'tiers' extra (redis-py) is not installed")
if find_redis_server() is None:
    pytest.fail("no redis-server binary found: run scripts/setup.sh", pytrace=False)

from kvmosaic.tiers.redis_tier import RedisTier  # noqa: E402 - after the checks above

SECRET = "replicas-share-this"
KEYS = TierKeys.from_secret(SECRET)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
PROMPT = [1000 + (i * 37) % 3000 for i in range(70)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(prefix_cache="none")
    out = llm.generate([PROMPT], PARAMS)[0]
    llm.engine.close()
    return out


def check_same(out, ref) -> None:
    assert out.finish_reason == ref.finish_reason
    assert out.token_ids == ref.token_ids
    for got, want in zip(out.logprobs, ref.logprobs):
        assert got.keys() == want.keys()
        for tok in got:
            assert abs(got[tok] - want[tok]) <= 1e-4


def values(raw, prefix: str) -> dict[bytes, bytes]:
    return {k: raw.get(k) for k in raw.scan_iter(match=prefix.encode() + b"*")}


def split(value: bytes) -> tuple[BlockMeta, np.ndarray]:
    """A stored value's meta (checksum-verified) and float32 payload, as a writer would read them."""
    _, _, _, meta_len, payload_len = struct.unpack_from("<4sHHIQ", value)
    start = HEADER_SIZE + meta_len
    return read_meta(value), np.frombuffer(value[start:start + payload_len], dtype=np.float32)


def engine_with_stored_prompt(server, **kw):
    prefix = f"kvmosaic:auth:{uuid.uuid4().hex[:8]}:"
    llm = make_llm(kv_tiers=[f"{server.url}?prefix={prefix}&timeout=1"], kv_tier_secret=SECRET, **kw)
    llm.generate([PROMPT], PARAMS)
    llm.engine.tiers.flush()
    return llm, prefix


def redis_stats(llm) -> dict:
    return llm.get_stats().kv_tiers["tiers"]["redis"]


# -- forged entries ----------------------------------------------------------------------------
@pytest.mark.parametrize("mac", ["none", "wrong-key"])
def test_a_forged_entry_is_never_served_counted_and_deleted(server, raw, reference, mac):
    llm, prefix = engine_with_stored_prompt(server)
    stored = values(raw, prefix)
    assert len(stored) == 4
    forged = {}
    for k, v in stored.items():  # a writer without the secret: other KV, a valid format and checksum
        meta, kv = split(v)
        forged[k] = encode_block(meta, (kv * -3.0 + 0.5).tobytes(), None if mac == "none" else b"w" * 32)
        raw.set(k, forged[k])
    assert llm.reset_prefix_cache()
    out = llm.generate([PROMPT], PARAMS)[0]
    check_same(out, reference)
    assert out.num_cached_tokens == 0
    st = redis_stats(llm)
    # each forged block a load touched (the loader fetches a request's blocks side by side)
    assert set(st["corrupt_reasons"]) == {"forged"} and st["corrupt"] >= 1
    assert st["authenticated"] and st["state"] == "up"
    llm.engine.tiers.flush()
    now = values(raw, prefix)
    assert all(now.get(k) != forged[k] for k in forged), "the forged entry was deleted (then re-stored, valid)"
    # what is there now is this engine's own, authentic write: it loads
    assert llm.reset_prefix_cache()
    check_same(again := llm.generate([PROMPT], PARAMS)[0], reference)
    assert again.num_cached_tokens == 64 and redis_stats(llm)["corrupt"] == st["corrupt"]
    llm.engine.tiers.stack[0].clear()
    llm.engine.close()


def test_without_a_secret_a_shared_tier_trusts_every_writer_and_says_so(server, raw, caplog):
    """What the secret is for: the same forgery against a stack without one is served (the
    documented, logged, checksum-only mode)."""
    prefix = f"kvmosaic:auth:{uuid.uuid4().hex[:8]}:"
    with caplog.at_level(logging.WARNING, logger="kvmosaic.tiers"):
        stack = TierStack([RedisTier(server.url, prefix=prefix)])
    assert any("unauthenticated" in r.getMessage() for r in caplog.records)
    meta = BlockMeta("fp", "float32", 4, "N", (16,), (1, 2, 3, 4), b"k" * 16)
    stack.store(b"k" * 16, meta, np.ones(16, np.float32).tobytes())
    raw.set(prefix.encode() + (b"k" * 16).hex().encode(), encode_block(meta, np.zeros(16, np.float32).tobytes()))
    assert stack.load(b"k" * 16, meta).payload == np.zeros(16, np.float32).tobytes()
    assert stack.stats()[stack[0].name]["authenticated"] is False
    with caplog.at_level(logging.WARNING, logger="kvmosaic.tiers"):
        caplog.clear()
        TierStack([RedisTier(server.url, prefix=prefix)], secret=SECRET)
    assert not caplog.records
    stack.clear()


def test_host_tiers_carry_a_per_process_mac_without_a_secret():
    host = HostTier(1 << 20)
    stack = TierStack([host])
    meta = BlockMeta("fp", "float32", 4, "N", (16,), (1, 2, 3, 4), b"h" * 16)
    assert stack.store(b"h" * 16, meta, bytes(64), "evict") == [0] and stack.mac_keys[0] is not None
    assert stack.load(b"h" * 16, meta).payload == bytes(64)
    host.put(b"h" * 16, encode_block(meta, bytes(64)))  # no MAC
    assert stack.load(b"h" * 16, meta) is None and host.stats.corrupt_reasons == {"forged": 1}
    assert not host.contains(b"h" * 16)


# -- non-finite payloads -----------------------------------------------------------------------
def test_nan_under_a_valid_mac_is_rejected_counted_deleted_and_the_request_succeeds(server, raw, reference):
    llm, prefix = engine_with_stored_prompt(server)
    stored = values(raw, prefix)
    poisoned = {}
    for k, v in stored.items():  # a writer holding the secret (or a broken one) stores NaN
        meta, kv = split(v)
        bad = kv.copy()
        bad[::97] = np.nan
        poisoned[k] = encode_block(meta, bad.tobytes(), KEYS.mac, KEYS.tokens)
        raw.set(k, poisoned[k])
    assert llm.reset_prefix_cache()
    out = llm.generate([PROMPT], PARAMS)[0]
    check_same(out, reference)
    assert out.num_cached_tokens == 0
    st = redis_stats(llm)
    assert set(st["corrupt_reasons"]) == {"nonfinite"} and st["corrupt"] >= 1
    llm.engine.tiers.flush()
    now = values(raw, prefix)
    assert all(now.get(k) != poisoned[k] for k in poisoned)
    llm.engine.tiers.stack[0].clear()
    llm.engine.close()


@pytest.mark.parametrize("dtype,bad", [("float32", np.float32(np.inf)), ("bfloat16", 0x7FC0), ("float16", 0xFC00)])
def test_every_float_dtype_is_checked_for_non_finite_values(dtype, bad):
    from kvmosaic.kv.block_io import nonfinite

    meta = BlockMeta("fp", dtype, 4, "N", (8,), (), b"")
    width = np.float32 if dtype == "float32" else np.uint16
    clean = np.arange(8).astype(np.float32 if dtype == "float32" else np.uint16)
    assert nonfinite(meta, clean.tobytes()) is None
    dirty = clean.copy()
    dirty[5] = bad
    assert nonfinite(meta, dirty.astype(width).tobytes()) == "nonfinite"


# -- token ids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [SECRET, None])
def test_no_token_id_is_readable_from_redis(server, raw, secret):
    prefix = f"kvmosaic:auth:{uuid.uuid4().hex[:8]}:"
    llm = make_llm(kv_tiers=[f"{server.url}?prefix={prefix}"], kv_tier_secret=secret)
    llm.generate([PROMPT], PARAMS)
    llm.engine.tiers.flush()
    stored = values(raw, prefix)
    assert len(stored) == 4
    blocks = [PROMPT[i:i + 16] for i in range(0, 64, 16)]
    for v in stored.values():
        _, _, _, meta_len, _ = struct.unpack_from("<4sHHIQ", v)
        head = v[:HEADER_SIZE + meta_len]
        meta = json.loads(head[HEADER_SIZE:])  # no id list: a 128-bit digest stands in for them
        assert "token_ids" not in meta and len(bytes.fromhex(meta["tokens"])) == 16
        assert not any(isinstance(x, list) and len(x) >= 16 for x in meta.values())
        for ids in blocks:
            for fmt in ("<16i", "<16q", "<16H"):  # the block's ids as a binary run, any width
                assert struct.pack(fmt, *ids) not in v
            assert ",".join(map(str, ids[:4])).encode() not in v  # as JSON text (format 1 stored that)
    llm.engine.tiers.stack[0].clear()
    llm.engine.close()


# -- a tier that loses its medium says so ---------------------------------------------------------
def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvmosaic.tiers" and r.levelno == logging.WARNING]


def test_disk_directory_lost_while_running_is_noticed_logged_recreated(tmp_path, caplog):
    root = tmp_path / "kv"
    disk = DiskTier(root, 1 << 20)
    stack = TierStack([disk], secret=SECRET)
    meta = BlockMeta("fp", "uint8", 4, "N", (64,), (1, 2, 3, 4))
    for i in range(3):
        stack.store(bytes([i]) * 16, meta, bytes(64))
    assert disk.used_bytes > 0 and stack.stats()["disk"]["state"] == "up"
    caplog.set_level(logging.WARNING, logger="kvmosaic.tiers")
    shutil.rmtree(root)
    st = stack.stats()["disk"]  # noticed by /health's own read, no traffic needed
    assert st["state"] == "failing" and "gone" in st["error"] and st["used_bytes"] == 0
    assert root.is_dir(), "recreated"
    assert stack.load(bytes([0]) * 16, meta) is None and stack.stats()["disk"]["state"] == "failing"
    assert stack.store(b"\x09" * 16, meta, bytes(64)) == [0]  # stores again
    st = stack.stats()["disk"]
    assert st["state"] == "up" and st["error"] is None and st["used_bytes"] == disk.used_bytes > 0
    logged = messages(caplog)
    assert len(logged) == 3, logged  # failing once, recreated once, up once
    assert "failing" in logged[0] and "recreated" in logged[1] and "up again" in logged[2]


def test_disk_directory_that_cannot_be_recreated_stays_failing_logged_once(tmp_path, caplog):
    root = tmp_path / "kv"
    disk = DiskTier(root, 1 << 20)
    stack = TierStack([disk], secret=SECRET)
    meta = BlockMeta("fp", "uint8", 4, "N", (64,), (1, 2, 3, 4))
    stack.store(b"\x01" * 16, meta, bytes(64))
    caplog.set_level(logging.WARNING, logger="kvmosaic.tiers")
    shutil.rmtree(root)
    root.write_bytes(b"in the way")  # mkdir will fail
    for i in range(5):
        assert stack.store(bytes([i]) * 16, meta, bytes(64)) == []
    st = stack.stats()["disk"]
    assert st["state"] == "failing" and st["errors"] == 5 and st["used_bytes"] == 0 and st["error"]
    assert len(messages(caplog)) == 1, messages(caplog)
    root.unlink()  # the operator fixes it: the next store recreates the directory and recovers
    assert stack.store(b"\x07" * 16, meta, bytes(64)) == [0]
    assert stack.stats()["disk"]["state"] == "up" and stack.load(b"\x07" * 16, meta) is not None
    assert "up again" in messages(caplog)[-1]


def test_disk_directory_removed_under_a_running_engine(tmp_path, caplog):
    spec = f"disk:{tmp_path / 'kv'}:64MiB"
    llm = make_llm(kv_tiers=[spec], kv_tier_secret=SECRET)
    llm.generate([PROMPT], PARAMS)
    llm.engine.tiers.flush()
    caplog.set_level(logging.WARNING, logger="kvmosaic.tiers")
    shutil.rmtree(tmp_path / "kv")
    st = llm.get_stats().kv_tiers["tiers"]["disk"]
    assert st["state"] == "failing" and st["used_bytes"] == 0
    assert llm.reset_prefix_cache()
    llm.generate([PROMPT], PARAMS)  # computed again, and stored again
    llm.engine.tiers.flush()
    st = llm.get_stats().kv_tiers["tiers"]["disk"]
    assert st["state"] == "up" and st["used_bytes"] > 0
    assert llm.reset_prefix_cache()
    assert llm.generate([PROMPT], PARAMS)[0].num_cached_tokens == 64
    assert [m for m in messages(caplog) if "failing" in m or "up again" in m] and len(messages(caplog)) == 3
    llm.engine.close()


def test_redis_going_away_and_back_is_logged_once_each(caplog):
    with RedisServer() as s:
        t = RedisTier(s.url, timeout=0.2, backoff=0.05, max_backoff=0.1)
        stack = TierStack([t], secret=SECRET)
        meta = BlockMeta("fp", "uint8", 4, "N", (64,), (1, 2, 3, 4))
        assert stack.store(b"\x01" * 16, meta, bytes(64)) == [0]
        caplog.set_level(logging.WARNING, logger="kvmosaic.tiers")
        s.kill()
        for _ in range(3):
            assert stack.load(b"\x01" * 16, meta) is None
        st = stack.stats()[t.name]
        assert st["state"] == "down" and "ConnectionError" in st["error"]
        assert len(messages(caplog)) == 1 and "down" in messages(caplog)[0]
        s.start()
        import time

        deadline = time.monotonic() + 5
        while not t.ping() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.stats()[t.name]["state"] == "up"
        assert len(messages(caplog)) == 2 and "up again" in messages(caplog)[1]
        t.close()


# -- the secret ---------------------------------------------------------------------------------
def test_the_secret_comes_from_the_flag_or_a_file_and_is_never_printed(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_secret(None, str(path)) == SECRET.encode() == load_secret(SECRET, None)
    assert load_secret() is None
    for bad in [dict(secret=SECRET, secret_file=str(path)), dict(secret="")]:
        with pytest.raises(ValueError):
            load_secret(**bad)
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(None, str(path))
    assert SECRET not in repr(EngineArgs(kv_tier_secret=SECRET)) and SECRET not in repr(KEYS)


def test_replicas_with_the_same_secret_file_read_each_others_entries(server, tmp_path, reference):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    prefix = f"kvmosaic:auth:{uuid.uuid4().hex[:8]}:"
    spec = f"{server.url}?prefix={prefix}"
    a = make_llm(kv_tiers=[spec], kv_tier_secret_file=str(path))
    a.generate([PROMPT], PARAMS)
    a.engine.tiers.flush()
    b = make_llm(kv_tiers=[spec], kv_tier_secret=SECRET)  # the flag, same secret: same keys
    out = b.generate([PROMPT], PARAMS)[0]
    check_same(out, reference)
    assert out.num_cached_tokens == 64 and redis_stats(b)["corrupt"] == 0
    c = make_llm(kv_tiers=[spec], kv_tier_secret="another")  # another secret: a's entries are forged to c
    out = c.generate([PROMPT], PARAMS)[0]
    check_same(out, reference)
    assert out.num_cached_tokens == 0 and redis_stats(c)["corrupt_reasons"].get("forged", 0) >= 1
    for llm in (a, b, c):
        llm.engine.tiers.stack[0].clear()
        llm.engine.close()
