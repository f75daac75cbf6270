"""The disk tier: round trips, restarts, crashes, corruption (kvmosaic/tiers/)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tier_blocks import key, meta, payload, value

from kvmosaic.tiers import (
    DiskTier,
    HostTier,
    TierStack,
    Trigger,
    encode_block,
)


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
