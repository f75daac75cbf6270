"""The LRU index host and disk share, and the host tier (kvmosaic/tiers/)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tier_blocks import key

from kvmosaic.tiers import (
    HostTier,
)
from kvmosaic.tiers.lru import LruIndex


# -- the LRU index host and disk share ---------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "get", "pop"]), st.integers(0, 7), st.integers(0, 120))))
def test_lru_index_bytes_exact_and_within_budget(ops):
    index: LruIndex[bytes] = LruIndex(300, len)
    order: list[bytes] = []  # a model of the use order
    for op, i, n in ops:
        k = key(i)
        if op == "insert":
            evicted = index.insert(k, bytes(n))
            if k in order:
                order.remove(k)
            order.append(k)
            for victim, _ in evicted:
                assert victim == order.pop(0)  # least recently used first
        elif op == "get":
            if index.get(k) is not None:
                order.remove(k)
                order.append(k)
        else:
            index.pop(k)
            if k in order:
                order.remove(k)
        assert index.used_bytes == sum(len(v) for v in index.values()) <= 300
        assert index.keys() == order


# -- host --------------------------------------------------------------------------------------
def test_host_round_trip_and_lru_eviction():
    t = HostTier(capacity_bytes=300)
    for i in range(3):
        assert t.put(key(i), bytes(100))
    assert t.used_bytes == 300
    assert t.get(key(0)) is not None  # 0 becomes most recent: 1 is now the oldest
    assert t.put(key(3), bytes(100))
    assert t.contains_many([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert t.used_bytes == 300 and t.stats.evictions == 1 and t.stats.bytes_evicted == 100
    assert t.keys() == [key(2), key(0), key(3)]


def test_host_refuses_a_value_larger_than_the_budget_and_keeps_the_rest():
    t = HostTier(capacity_bytes=100)
    t.put(key(0), bytes(50))
    assert not t.put(key(1), bytes(101))
    assert t.contains(key(0)) and t.used_bytes == 50 and t.stats.store_rejected == 1


def test_host_replace_and_delete_keep_bytes_exact():
    t = HostTier(capacity_bytes=1000)
    t.put(key(0), bytes(100))
    t.put(key(0), bytes(40))
    assert t.used_bytes == 40 and len(t) == 1
    t.delete(key(0))
    t.delete(key(0))
    assert t.used_bytes == 0
    t.put(key(1), bytes(10))
    t.clear()
    assert t.used_bytes == 0 and len(t) == 0


def test_stats_snapshot():
    t = HostTier(capacity_bytes=1000)
    t.put(key(0), b"abc")
    t.get(key(0))
    t.get(key(1))
    t.contains_many([key(0), key(1)])
    s = t.stats.snapshot()
    assert (s["stores"], s["bytes_stored"], s["loads"], s["load_hits"], s["bytes_loaded"]) == (1, 3, 2, 1, 3)
    assert (s["queries"], s["hits"]) == (2, 1)
    assert s["load_latency_count"] == 1 and sum(s["load_latency_buckets"]) == 1
