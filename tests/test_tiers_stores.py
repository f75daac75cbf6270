"""Host and disk tiers, the TierStack, the loader and the spec parser (kvmosaic/tiers/)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmosaic.tiers import (
    BlockMeta,
    DiskTier,
    HostTier,
    Policy,
    TierLoader,
    TierStack,
    Trigger,
    encode_block,
    parse_size,
    parse_tier_spec,
)
from kvmosaic.tiers.lru import LruIndex


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def meta(i: int, n: int = 64, fingerprint: str = "model-a") -> BlockMeta:
    return BlockMeta(fingerprint=fingerprint, dtype="uint8", block_size=4, layout="N", shape=(n,),
                     token_ids=(i, i + 1, i + 2, i + 3), block_hash=key(i))


def payload(i: int, n: int = 64) -> bytes:
    return bytes([i % 251]) * n


def value(i: int, n: int = 64) -> bytes:
    return encode_block(meta(i, n), payload(i, n))


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


# -- disk --------------------------------------------------------------------------------------
def test_disk_round_trip_and_restart(tmp_path):
    t = DiskTier(tmp_path, capacity_bytes=10_000)
    assert t.put(key(1), value(1)) and t.put(key(2), value(2))
    assert t.get(key(1)) == value(1)
    t2 = DiskTier(tmp_path, capacity_bytes=10_000)
    assert len(t2) == 2 and t2.used_bytes == t.used_bytes
    assert t2.get(key(2)) == value(2)
    assert t.path_for(key(1)).parent.name == key(1).hex()[:2]


def test_disk_lru_order_survives_restart(tmp_path):
    t = DiskTier(tmp_path, capacity_bytes=10_000)
    for i in range(3):
        t.put(key(i), bytes(100))
        time.sleep(0.01)
    t.get(key(0))  # touches the mtime: 1 is now the least recently used
    t2 = DiskTier(tmp_path, capacity_bytes=10_000)
    assert t2.keys() == [key(1), key(2), key(0)]
    t3 = DiskTier(tmp_path, capacity_bytes=200)  # a smaller budget evicts the oldest on open
    assert t3.keys() == [key(2), key(0)] and t3.used_bytes == 200
    assert not t3.path_for(key(1)).exists()


def test_disk_eviction_by_bytes(tmp_path):
    t = DiskTier(tmp_path, capacity_bytes=250, fsync=False)
    for i in range(5):
        t.put(key(i), bytes(100))
    assert t.keys() == [key(3), key(4)] and t.used_bytes == 200
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) == 2 and sum(p.stat().st_size for p in files) == 200
    assert not t.put(key(9), bytes(251))


def test_disk_file_removed_behind_its_back_is_a_miss(tmp_path):
    t = DiskTier(tmp_path, capacity_bytes=10_000)
    t.put(key(1), b"x" * 10)
    t.path_for(key(1)).unlink()
    assert t.get(key(1)) is None and not t.contains(key(1)) and t.used_bytes == 0


def test_disk_leftover_temp_files_are_deleted_on_open(tmp_path):
    t = DiskTier(tmp_path, capacity_bytes=10_000)
    t.put(key(1), b"x" * 10)
    tmp = t.path_for(key(2)).parent / f".{key(2).hex()}.123.abcd.tmp"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"partial")
    t2 = DiskTier(tmp_path, capacity_bytes=10_000)
    assert t2.removed_temp_files == 1 and not tmp.exists() and len(t2) == 1


_CRASH = textwrap.dedent(
    """
    import os, sys, time
    from kvmosaic.tiers.disk import DiskTier
    t = DiskTier(sys.argv[1], 1 << 20)
    def stuck(src, dst):
        print(src, flush=True)
        time.sleep(60)
    os.replace = stuck  # the write is done and fsynced; the rename never happens
    t.put(bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]))
    """
)


def _crash_during_put(root: Path, k: bytes, v: bytes) -> Path:
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(root), k.hex(), v.hex()],
                            stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(proc.stdout.readline().strip())
        assert tmp.exists() and tmp.stat().st_size == len(v)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return tmp


def test_disk_crash_before_rename_leaves_nothing(tmp_path):
    tmp = _crash_during_put(tmp_path, key(7), value(7))
    t = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert not t.contains(key(7)) and t.get(key(7)) is None and not tmp.exists()
    assert t.used_bytes == 0 and not list(tmp_path.rglob("*.tmp"))


def test_disk_crash_before_rename_keeps_the_old_entry(tmp_path):
    DiskTier(tmp_path, capacity_bytes=1 << 20).put(key(7), value(7))
    _crash_during_put(tmp_path, key(7), value(8, 80))
    stack = TierStack([DiskTier(tmp_path, capacity_bytes=1 << 20)])
    assert stack.load(key(7), meta(7)).payload == payload(7)


# -- the stack: verification, corruption ---------------------------------------------------------
def _disk_stack(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20)
    stack = TierStack([disk])
    stack.store(key(1), meta(1), payload(1))
    stack.store(key(2), meta(2), payload(2))
    return stack, disk


def _flip(path: Path, pos: int):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda d: _flip(d.path_for(key(1)), -30), "checksum"),
        (lambda d: d.path_for(key(1)).write_bytes(d.path_for(key(1)).read_bytes()[:-9]), "truncated"),
        (lambda d: shutil.copyfile(d.path_for(key(2)), d.path_for(key(1))), "tokens"),
        (lambda d: d.path_for(key(1)).write_bytes(
            encode_block(meta(1, fingerprint="model-b"), payload(1))), "fingerprint"),
        (lambda d: d.path_for(key(1)).write_bytes(
            encode_block(dataclasses.replace(meta(1), block_hash=key(9)), payload(1))), "key"),
    ],
    ids=["flip", "truncate", "other-block", "fingerprint", "same-tokens-other-key"],
)
def test_disk_corruption_is_a_counted_miss_and_the_entry_is_dropped(tmp_path, damage, why):
    stack, disk = _disk_stack(tmp_path)
    damage(disk)
    assert stack.load(key(1), meta(1)) is None
    assert disk.stats.corrupt == 1 and disk.stats.corrupt_reasons == {why: 1}
    assert not disk.contains(key(1)) and not disk.path_for(key(1)).exists()
    assert stack.load(key(2), meta(2)).payload == payload(2)  # the neighbour is untouched
    assert stack.stats()["disk"]["corrupt_reasons"] == {why: 1}


def test_a_corrupt_fast_copy_falls_through_to_a_good_slow_copy(tmp_path):
    host = HostTier(1 << 20)
    disk = DiskTier(tmp_path, 1 << 20)
    stack = TierStack([host, disk])
    stack.store(key(1), meta(1), payload(1), Trigger.FULL)  # disk (write-through)
    host.put(key(1), value(1)[:-1])
    got = stack.load(key(1), meta(1))
    assert got.payload == payload(1) and got.tier == 1 and got.medium == "disk"
    assert host.stats.corrupt_reasons == {"truncated": 1} and not host.contains(key(1))


def test_lookup_is_the_longest_contiguous_prefix_fastest_tier_first(tmp_path):
    host, disk = HostTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    stack = TierStack([host, disk])
    for i in (0, 1, 2, 4):
        disk.put(key(i), value(i))
    host.put(key(1), stack.encode(key(1), meta(1), payload(1), 0))  # a host tier's value carries its MAC
    keys = [key(i) for i in range(6)]
    assert stack.lookup(keys) == [1, 0, 1, None, None, None]
    assert stack.longest_prefix(keys) == 3
    assert stack.lookup([]) == [] and TierStack([]).lookup(keys[:2]) == [None, None]
    assert stack.load(key(1), meta(1)).tier == 0
    assert stack.load(key(1), meta(1), tier=1).tier == 1


def test_policies_default_per_medium_and_decide_what_is_stored(tmp_path):
    host = HostTier(1 << 20)
    disk = DiskTier(tmp_path, 1 << 20)
    sel = HostTier(1 << 20, name="sel", policy="write_through_selective", hit_threshold=2)
    assert (host.policy, disk.policy) == (Policy.WRITE_BACK, Policy.WRITE_THROUGH)
    stack = TierStack([host, disk, sel])
    assert stack.store(key(1), meta(1), payload(1), Trigger.FULL) == [1]
    assert stack.store(key(1), meta(1), payload(1), Trigger.HIT, hits=1) == []
    assert stack.store(key(1), meta(1), payload(1), Trigger.HIT, hits=2) == [2]
    assert stack.store(key(1), meta(1), payload(1), Trigger.HIT, hits=3) == []  # already there
    assert stack.store(key(1), meta(1), payload(1), Trigger.EVICT) == [0]
    assert [stack.load(key(1), meta(1), tier=i).tier for i in range(3)] == [0, 1, 2]


# -- loader ------------------------------------------------------------------------------------
class SlowHost(HostTier):
    """A host tier whose reads take ``delay`` seconds (to exercise deadlines)."""

    def __init__(self, *a, delay=0.0, fail=False, **kw):
        super().__init__(*a, **kw)
        self.delay, self.fail = delay, fail

    def get(self, k):
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("medium exploded")
        return super().get(k)


def test_loader_loads_in_the_background():
    host = SlowHost(1 << 20, delay=0.01)
    stack = TierStack([host])
    for i in range(4):
        host.put(key(i), stack.encode(key(i), meta(i), payload(i), 0))
    with TierLoader(stack, timeout=5) as loader:
        futs = loader.submit_many([key(i) for i in range(5)], [meta(i) for i in range(5)])
        got = loader.gather(futs)
    assert [g.payload for g in got[:4]] == [payload(i) for i in range(4)] and got[4] is None


def test_loader_late_load_is_a_miss_counted_once():
    host = SlowHost(1 << 20, delay=0.3)
    stack = TierStack([host])
    host.put(key(1), stack.encode(key(1), meta(1), payload(1), 0))
    with TierLoader(stack) as loader:
        t0 = time.monotonic()
        fut = loader.submit(key(1), meta(1), tier=0, timeout=0.05)
        assert loader.result(fut) is None
        assert time.monotonic() - t0 < 0.25  # did not wait for the slow read
        assert fut.result() is None  # the late value is dropped
    assert loader.late_loads == 1 and host.stats.late_loads == 1


def test_loader_failed_load_is_a_miss():
    stack = TierStack([SlowHost(1 << 20, fail=True)])
    with TierLoader(stack) as loader:
        assert loader.result(loader.submit(key(1), meta(1))) is None
    assert loader.failed_loads == 1


# -- spec parser -------------------------------------------------------------------------------
def test_parse_size():
    assert parse_size("4GiB") == 4 << 30 and parse_size("20GB") == 20 * 10**9
    assert parse_size("512") == 512 and parse_size("1.5k") == 1536 and parse_size("2 mib") == 2 << 20
    with pytest.raises(ValueError):
        parse_size("lots")


def test_parse_host_and_disk_specs(tmp_path):
    s = parse_tier_spec("host:4GiB")
    assert (s.medium, s.capacity_bytes, s.policy) == ("host", 4 << 30, None)
    assert parse_tier_spec("host:1MB:write_through").policy is Policy.WRITE_THROUGH
    s = parse_tier_spec("disk:/var/cache/kvmosaic:20GiB")
    assert (s.medium, s.path, s.capacity_bytes) == ("disk", "/var/cache/kvmosaic", 20 << 30)
    s = parse_tier_spec("disk:C:/weird:path:1GB?policy=write_through_selective&k=3&fsync=0")
    assert s.path == "C:/weird:path" and s.policy is Policy.WRITE_THROUGH_SELECTIVE
    assert s.options == {"hit_threshold": 3, "fsync": False}
    tier = parse_tier_spec(f"disk:{tmp_path}:1MiB:write_back").build()
    assert isinstance(tier, DiskTier) and tier.policy is Policy.WRITE_BACK and tier.capacity_bytes == 1 << 20
    assert parse_tier_spec("host:?capacity=2KiB").capacity_bytes == 2048


def test_parse_redis_spec():
    s = parse_tier_spec("redis://127.0.0.1:6379")
    assert (s.medium, s.url, s.capacity_bytes, s.policy) == ("redis", "redis://127.0.0.1:6379", None, None)
    s = parse_tier_spec("redis://h:1/2?ttl=60&timeout=0.2&capacity=1GiB&policy=write_back&db=3")
    assert s.url == "redis://h:1/2?db=3" and s.capacity_bytes == 1 << 30
    assert s.options == {"ttl_s": 60.0, "timeout": 0.2} and s.policy is Policy.WRITE_BACK


@pytest.mark.parametrize("bad", ["host", "ssd:1GB", "disk:1GB", "host:1GB?policy=never",
                                 "host:1GB?fsync=1", "redis://h?timeout=fast", "host:1GB:2GB"])
def test_parse_rejects_bad_specs(bad):
    with pytest.raises(ValueError):
        parse_tier_spec(bad)


# -- byte accounting under any sequence of operations ------------------------------------------------
SIZES = [0, 10, 100, 700, 1500]


class TierStackMachine(RuleBasedStateMachine):
    """Host (write-back) over disk (write-through): each tier's used_bytes equals what it holds
    (on disk: the files' sizes), stays within budget, and a load returns the stored payload or
    nothing — also across a restart of the disk tier and after corruption."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvmosaic-tiers-")
        self.host = HostTier(3000)
        self.disk = DiskTier(self.dir, 5000, fsync=False)
        self.stack = TierStack([self.host, self.disk])
        self.damaged: set[bytes] = set()  # files shortened behind the index's back

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, 11), trigger=st.sampled_from(list(Trigger)))
    def store(self, i, trigger):
        n = SIZES[i % len(SIZES)]
        if 1 in self.stack.store(key(i), meta(i, n), payload(i, n), trigger, hits=3):
            self.damaged.discard(key(i))

    @rule(i=st.integers(0, 11))
    def load(self, i):
        n = SIZES[i % len(SIZES)]
        got = self.stack.load(key(i), meta(i, n))
        assert got is None or got.payload == payload(i, n)

    @rule(i=st.integers(0, 11))
    def delete(self, i):
        self.stack.delete(key(i))

    @rule(i=st.integers(0, 11), cut=st.integers(1, 50))
    def corrupt_on_disk(self, i, cut):
        p = self.disk.path_for(key(i))
        if p.exists():
            p.write_bytes(p.read_bytes()[:-cut])  # size on disk now differs from the index
            self.damaged.add(key(i))

    @rule()
    def restart_disk(self):
        self.disk = DiskTier(self.dir, 5000, fsync=False)
        self.stack.tiers[1] = self.disk
        self.damaged.clear()  # the new index reads the files' true sizes

    @invariant()
    def bytes_are_exact(self):
        held = sum(len(v) for v in self.host._lru.values())
        assert self.host.used_bytes == held <= self.host.capacity_bytes
        files = {bytes.fromhex(p.stem): p.stat().st_size for p in Path(self.dir).rglob("*") if p.is_file()}
        index = dict(self.disk._lru)
        assert set(files) == set(index)  # no temp files, no orphans, nothing missing
        assert self.disk.used_bytes == sum(index.values()) <= self.disk.capacity_bytes
        assert all(files[k] == index[k] for k in index if k not in self.damaged)


TierStackMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_tier_stack_accounting = TierStackMachine.TestCase
