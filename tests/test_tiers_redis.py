"""The Redis tier against a real redis-server (started here on a free loopback port; no fakes):
round trips, Redis's own memory bound, corruption, two processes sharing blocks, and outages
(killed, paused, restarted) that cost misses and never raise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from kvmosaic.tiers import TierStack, encode_block, parse_tier_spec
from kvmosaic.tiers.redis_server import RedisServer, find_redis_server

redis = pytest.importorskip("redis", reason="the 'tiers' extra (redis-py) is not installed")
if find_redis_server() is None:  # scripts/setup.sh installs one; say so loudly rather than skip
    pytest.fail("no redis-server binary found: run scripts/setup.sh", pytrace=False)

from tier_blocks import key, meta, payload  # noqa: E402

from kvmosaic.tiers.redis_tier import RedisTier  # noqa: E402 - after the checks above


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
def tier(server):
    t = RedisTier(server.url, prefix=f"kvmosaic:test:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    yield t
    t.clear()
    t.close()


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_round_trip_and_batched_exists(tier):
    assert tier.put(key(1), b"one") and tier.put(key(3), b"three")
    assert tier.get(key(1)) == b"one" and tier.get(key(2)) is None
    assert tier.contains_many([key(1), key(2), key(3)]) == [True, False, True]
    assert tier.longest_prefix([key(1), key(2), key(3)]) == 1
    tier.delete(key(1))
    assert not tier.contains(key(1))
    s = tier.stats.snapshot()
    assert (s["stores"], s["loads"], s["load_hits"], s["queries"], s["hits"], s["errors"]) == (2, 2, 1, 7, 4, 0)
    assert tier.state == "up" and tier.policy.value == "write_through"


def test_one_set_per_block_under_the_prefix_and_clear_keeps_other_keys(server, raw):
    t = RedisTier(server.url)
    t.put(key(5), b"v")
    assert raw.get(b"kvmosaic:kv:" + key(5).hex().encode()) == b"v"
    raw.set(b"someone-else", b"x")
    t.clear()
    assert not t.contains(key(5)) and raw.get(b"someone-else") == b"x"
    raw.delete(b"someone-else")


def test_ttl(server):
    t = RedisTier(server.url, prefix="kvmosaic:ttl:", ttl_s=0.1)
    t.put(key(1), b"v")
    assert t.contains(key(1))
    assert wait_until(lambda: not t.contains(key(1)), timeout=3)


def test_stack_round_trip_from_a_spec(server):
    t = parse_tier_spec(f"{server.url}?timeout=0.2&prefix=kvmosaic:spec:").build()
    assert isinstance(t, RedisTier) and t.timeout == 0.2
    stack = TierStack([t])
    assert stack.store(key(1), meta(1), payload(1)) == [0]  # write-through by default
    got = stack.load(key(1), meta(1))
    assert got.payload == payload(1) and got.medium == "redis"
    t.clear()


@pytest.mark.parametrize("why", ["checksum", "truncated", "tokens", "fingerprint"])
def test_corrupt_entry_is_a_counted_miss_and_dropped(tier, raw, why):
    stack = TierStack([tier])
    stack.store(key(1), meta(1), payload(1))
    stack.store(key(2), meta(2), payload(2))
    rkey = tier._k(key(1))
    good = raw.get(rkey)
    bad = {
        "checksum": good[:-20] + bytes([good[-20] ^ 1]) + good[-19:],
        "truncated": good[: len(good) // 2],
        "tokens": raw.get(tier._k(key(2))),  # a valid entry of another block under this key
        "fingerprint": encode_block(meta(1, fingerprint="model-b"), payload(1)),
    }[why]
    raw.set(rkey, bad)
    assert stack.load(key(1), meta(1)) is None
    assert tier.stats.corrupt_reasons == {why: 1} and raw.exists(rkey) == 0
    assert stack.load(key(2), meta(2)).payload == payload(2)


def test_two_processes_share_blocks(server):
    prefix = f"kvmosaic:share:{uuid.uuid4().hex[:8]}:"
    writer = textwrap.dedent(
        f"""
        from kvmosaic.tiers import BlockMeta, TierStack
        from kvmosaic.tiers.redis_tier import RedisTier
        stack = TierStack([RedisTier({server.url!r}, prefix={prefix!r})])
        for i in range(3):
            k = i.to_bytes(4, "big") * 4
            m = BlockMeta("model-a", "uint8", 4, "N", (64,), (i, i + 1, i + 2, i + 3), k)
            assert stack.store(k, m, bytes([i]) * 64) == [0]
        """
    )
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)
    stack = TierStack([RedisTier(server.url, prefix=prefix)])
    assert stack.longest_prefix([key(0), key(1), key(2), key(3)]) == 3
    assert [stack.load(key(i), meta(i)).payload for i in range(3)] == [payload(i) for i in range(3)]
    stack.clear()


def test_redis_bounds_its_own_memory_with_allkeys_lru():
    with RedisServer(maxmemory="4mb") as s:
        t = RedisTier(s.url)
        assert all(t.put(key(i), bytes(100_000)) for i in range(120))  # 12 MB into 4 MB
        info = t.server_info()
        assert info["maxmemory_policy"] == "allkeys-lru" and info["evicted_keys"] > 0
        assert info["used_memory"] <= info["maxmemory"] * 1.1 and t.used_bytes == info["used_memory"]
        # Redis's LRU is approximate (it evicts the oldest of a few sampled keys): the newest key
        # stays and most of the oldest are gone, though any one old key may survive.
        assert t.contains(key(119)) and t.stats.errors == 0
        assert sum(t.contains(key(i)) for i in range(40)) <= 10


def test_killed_redis_costs_misses_then_hits_return_after_restart():
    with RedisServer() as s:
        t = RedisTier(s.url, timeout=0.2, backoff=0.1, max_backoff=0.4)
        stack = TierStack([t])
        stack.store(key(1), meta(1), payload(1))
        s.kill()
        assert stack.load(key(1), meta(1)) is None  # no exception
        assert t.state == "down" and t.stats.errors == 1 and "ConnectionError" in t.last_error
        t0 = time.monotonic()
        assert stack.lookup([key(1), key(2)]) == [None, None]
        assert not t.put(key(2), b"x") and t.get(key(2)) is None
        assert time.monotonic() - t0 < 0.05  # inside the backoff: no network at all
        assert wait_until(lambda: (t.get(key(3)), t.stats.errors >= 2)[1], timeout=3)  # probes fail
        assert t.state == "down"

        s.start()  # same port, empty (no persistence)
        raw = redis.Redis.from_url(s.url)
        stack_other = TierStack([RedisTier(s.url)])
        stack_other.store(key(1), meta(1), payload(1))  # another process refills it
        assert wait_until(lambda: stack.load(key(1), meta(1)) is not None, timeout=5)
        assert t.state == "up" and stack.lookup([key(1)]) == [0]
        raw.close()


def test_paused_redis_times_out_as_a_miss(server, raw):
    tier = RedisTier(server.url, prefix="kvmosaic:pause:", timeout=0.1, backoff=0.1)
    tier.put(key(1), b"v")
    raw.execute_command("CLIENT", "PAUSE", 600)  # the server stops answering for 0.6 s
    t0 = time.monotonic()
    assert tier.get(key(1)) is None
    assert time.monotonic() - t0 < 0.4 and tier.state == "down" and tier.stats.errors == 1
    assert "Timeout" in tier.last_error
    assert wait_until(lambda: tier.get(key(1)) == b"v", timeout=5)
    assert tier.state == "up"
    tier.clear()


def test_redis_server_helper(server):
    assert server.running and server.url.startswith("redis://127.0.0.1:")
    clash = RedisServer(port=server.port)
    with pytest.raises(RuntimeError, match="already answers"):  # never mistake another server for ours
        clash.start()
    assert not clash.running


def test_calls_in_flight_when_redis_dies_do_not_grow_the_backoff():
    """Several threads' calls failing at once count as one failure: the next probe comes after
    one backoff period, not after 2**n of them."""
    with RedisServer() as server:
        tier = RedisTier(server.url, timeout=0.2, backoff=0.3)
        assert tier.put(b"k", b"v")
        server.kill()
        for _ in range(6):  # as if six loader threads' calls failed together
            tier._failed(ConnectionError("gone"))
        assert tier.state == "down" and tier._backoff == 0.3
        server.start()
        time.sleep(0.35)
        tier.put(b"k2", b"v")
        assert tier.state == "up"
        tier.close()
