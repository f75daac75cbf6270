"""KV events in current vLLM's wire format (issue 21): what a router built on
``vllm.distributed.kv_events`` (llm-d, Dynamo, Ray's KV-aware router) decodes.

* always: a real publisher's frames decode with a schema that restates vLLM 0.33's (an
  array-like ``KVEventBatch`` of events as tagged maps; ``lora_name`` required);
* where vLLM is installed (``scripts/install_vllm_cpu.sh``: ``.venv-vllm``, or
  ``KVMOSAIC_VLLM_PYTHON``; ``KVMOSAIC_VLLM_PYTHONPATH`` can put another release's sources, e.g.
  an unpacked ``vllm==0.33.0`` wheel, ahead of it): decoded by vLLM's own classes, in its own
  interpreter. Measured 2026-11-23: vllm-cpu 0.32.0 and vllm 0.33.0 both decode them.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvmosaic.cache import events as ce
from kvmosaic.server.events import ZmqEventPublisher
from kvmosaic.server.launch import free_port


class VStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


def published_frames(wire_format: str = "vllm") -> list[list[bytes]]:
    """The frames a real publisher sends for one batch of each event kind."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(endpoint, wire_format=wire_format)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.3)
        pub.publish([ce.BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16, medium="CPU"),
                     ce.BlockRemoved([b"\x01" * 32], medium="CPU"), ce.AllBlocksCleared()])
        assert sub.poll(10_000), "nothing published"
        return [sub.recv_multipart()]
    finally:
        sub.close(linger=0)
        pub.close()


def test_frames_are_vllm_033_tagged_maps():
    (topic, seq, payload), = published_frames()
    assert topic == b"" and int.from_bytes(seq, "big") == 0
    raw = msgspec.msgpack.decode(payload)  # [ts, [event maps], rank]: vLLM's EventBatch is array-like
    assert isinstance(raw, list) and [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved",
                                                                     "AllBlocksCleared"]
    batch = msgspec.msgpack.decode(payload, type=VBatch)
    stored, removed, _ = batch.events
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32] and stored.token_ids == list(range(32))
    assert stored.lora_name is None and stored.group_idx == 0 and stored.kv_cache_spec_kind == "full_attention"
    assert removed.block_hashes == [b"\x01" * 32] and removed.medium == "CPU"


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """vLLM's earlier layout (up to 0.10), restated: events as tagged arrays."""


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldStored | OldRemoved | OldCleared]
    data_parallel_rank: int | None = None


def test_the_earlier_array_layout_behind_a_flag():
    (_, _, payload), = published_frames("array")
    raw = msgspec.msgpack.decode(payload)
    assert [e[0] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"], raw[1]
    stored, removed, _ = msgspec.msgpack.decode(payload, type=OldBatch).events
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32] and stored.token_ids == list(range(32))
    assert stored.block_size == 16 and stored.medium == "CPU" and removed.block_hashes == [b"\x01" * 32]
    with pytest.raises(ValueError, match="format"):
        ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", wire_format="json")


VLLM_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
batch = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=KVEventBatch)
s, r, c = batch.events
assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
print(len(s.block_hashes), s.block_size, len(s.token_ids), s.medium, s.kv_cache_spec_kind, r.block_hashes[0].hex()[:4])
"""


def vllm_python() -> str | None:
    exe = os.environ.get("KVMOSAIC_VLLM_PYTHON") or str(Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python")
    return exe if os.path.exists(exe) else None


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (scripts/install_vllm_cpu.sh)")
def test_vllms_own_classes_decode_them():
    (_, _, payload), = published_frames()
    env = {**os.environ, "PYTHONPATH": os.environ.get("KVMOSAIC_VLLM_PYTHONPATH", "")}
    done = subprocess.run([vllm_python(), "-c", VLLM_DECODE], input=payload, capture_output=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split()[-6:] == ["2", "16", "32", "CPU", "full_attention", "0101"]
