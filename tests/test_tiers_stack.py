"""The TierStack over host and disk, the loader and the spec parser (kvmosaic/tiers/)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tier_blocks import key, meta, payload, value

from kvmosaic.tiers import (
    DiskTier,
    HostTier,
    Policy,
    TierLoader,
    TierStack,
    Trigger,
    parse_size,
    parse_tier_spec,
)


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
