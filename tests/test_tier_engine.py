"""The storage tiers wired into the engine, both prefix-cache backends (issue 11, phase 2).

Invariant 1 with tiers: a prefix loaded from the host, disk or Redis tier gives the no-cache
engine's outputs (greedy token ids equal, float32 logprobs within 1e-4); restart reuse through a
disk directory; two engine processes sharing one real Redis; a corrupted disk entry is a counted
miss; a Redis killed mid-run costs misses, never failed requests; a load past its deadline is
computed. Real redis-server (kvmosaic.tiers.redis_server), no fakes.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from kvmosaic import SamplingParams
from kvmosaic.tiers.redis_server import RedisServer, find_redis_server
from tests.conftest import make_llm

BACKENDS = ["hash", "radix"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def prompt(seed: int, n: int = 70) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 4000 for i in range(n)]


PROMPTS = [prompt(1), prompt(1)[:50] + prompt(2)[:25], prompt(3, 90)]


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(prefix_cache="none")
    return {tuple(p): llm.generate([p], PARAMS)[0] for p in PROMPTS + [prompt(7), prompt(8), prompt(9)]}


@pytest.fixture(scope="module")
def redis_server():
    if find_redis_server() is None:
        pytest.fail("no redis-server binary found: run scripts/setup.sh", pytrace=False)
    with RedisServer() as s:
        yield s


def check_same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    for got, want in zip(out.logprobs, ref.logprobs):
        assert got.keys() == want.keys()
        for tok in got:
            assert abs(got[tok] - want[tok]) <= 1e-4


def run_all(llm, reference, prompts=PROMPTS):
    outs = [llm.generate([p], PARAMS)[0] for p in prompts]
    for p, o in zip(prompts, outs):
        check_same(o, reference[tuple(p)])
    return outs


def tier_stats(llm) -> dict:
    return llm.get_stats().kv_tiers["tiers"]


def redis_spec(server) -> str:
    return f"{server.url}?prefix=kvmosaic:t:{uuid.uuid4().hex[:8]}:&backoff=0.05&timeout=0.3"


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_tier_write_back_after_eviction(backend, reference):
    # 8 blocks: each prompt takes 5-6, so running the others evicts the first one's blocks,
    # which go to the host tier (write_back) and come back from it.
    llm = make_llm(prefix_cache=backend, num_kv_blocks=8, kv_tiers=["host:64MiB"])
    run_all(llm, reference)
    assert llm.get_stats().num_evictions > 0
    outs = run_all(llm, reference)
    assert outs[0].num_cached_tokens >= 64
    st = tier_stats(llm)["host"]
    assert st["hit_tokens"] > 0 and st["stores"] > 0 and st["corrupt"] == 0
    llm.engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("medium", ["disk", "redis"])
def test_write_through_tier_after_reset(backend, medium, reference, tmp_path, redis_server):
    spec = f"disk:{tmp_path}:64MiB" if medium == "disk" else redis_spec(redis_server)
    llm = make_llm(prefix_cache=backend, kv_tiers=[spec])
    run_all(llm, reference)
    llm.engine.tiers.flush()
    assert llm.reset_prefix_cache()  # the pool forgets everything; the tier still has it
    outs = run_all(llm, reference)
    assert all(o.num_cached_tokens >= 48 for o in outs)
    st = tier_stats(llm)[medium]
    assert st["hit_tokens"] >= outs[0].num_cached_tokens > 0  # later prompts also hit the reloaded pool
    if medium == "redis":
        llm.engine.tiers.stack[0].clear()
    llm.engine.close()


def test_restart_reuses_disk_tier(reference, tmp_path):
    a = make_llm(kv_tiers=[f"disk:{tmp_path}:64MiB"])
    run_all(a, reference)
    a.engine.close()
    del a
    gc.collect()
    b = make_llm(kv_tiers=[f"disk:{tmp_path}:64MiB"])
    outs = run_all(b, reference)
    assert all(o.num_cached_tokens > 0 for o in outs)
    b.engine.close()


def test_corrupt_disk_entry_is_a_counted_miss(reference, tmp_path):
    a = make_llm(kv_tiers=[f"disk:{tmp_path}:64MiB"])
    run_all(a, reference, PROMPTS[:1])
    a.engine.close()
    files = [f for f in Path(tmp_path).rglob("*") if f.is_file() and f.stat().st_size > 1000]
    assert files
    for f in files:  # flip one byte in the middle of each payload
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    b = make_llm(kv_tiers=[f"disk:{tmp_path}:64MiB"])
    out = run_all(b, reference, PROMPTS[:1])[0]
    assert out.num_cached_tokens == 0
    st = tier_stats(b)["disk"]
    assert st["corrupt"] >= 1 and st["corrupt_reasons"].get("checksum", 0) >= 1
    b.engine.close()


def test_load_past_deadline_is_computed(reference, tmp_path):
    a = make_llm(kv_tiers=[f"disk:{tmp_path}:64MiB"], kv_tier_load_timeout=0.0)
    run_all(a, reference, PROMPTS[:1])
    a.engine.tiers.flush()
    assert a.reset_prefix_cache()
    out = run_all(a, reference, PROMPTS[:1])[0]
    assert out.num_cached_tokens == 0
    assert a.get_stats().kv_tiers["load_failures"] > 0
    a.engine.close()


def test_two_processes_share_redis(reference, redis_server):
    spec = redis_spec(redis_server)
    p = prompt(7)
    code = textwrap.dedent(f"""
        from kvmosaic import LLM, SamplingParams
        llm = LLM(dtype="float32", device="cpu", num_kv_blocks=64, kv_tiers=[{spec!r}])
        llm.generate([{p!r}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        llm.engine.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent, timeout=120)
    llm = make_llm(kv_tiers=[spec])
    out = run_all(llm, reference, [p])[0]
    assert out.num_cached_tokens == 64
    assert tier_stats(llm)["redis"]["hit_tokens"] == 64
    llm.engine.tiers.stack[0].clear()
    llm.engine.close()


def test_redis_killed_mid_run_costs_misses_only(reference):
    with RedisServer() as server:
        llm = make_llm(kv_tiers=[redis_spec(server)])
        run_all(llm, reference, [prompt(8)])
        llm.engine.tiers.flush()
        server.kill()
        assert llm.reset_prefix_cache()
        outs = run_all(llm, reference, [prompt(8), prompt(9)])  # still served, just computed
        assert outs[0].num_cached_tokens == 0
        st = tier_stats(llm)["redis"]
        assert st["errors"] > 0 and st["state"] == "down"
        server.start()
        time.sleep(0.2)  # past the backoff: the tier reconnects and hits come back
        run_all(llm, reference, [prompt(9)])
        llm.engine.tiers.flush()
        assert llm.reset_prefix_cache()
        deadline = time.monotonic() + 30  # generous: each round may take seconds on a loaded machine
        while True:
            out = run_all(llm, reference, [prompt(9)])[0]
            if out.num_cached_tokens > 0 or time.monotonic() > deadline:
                break
            llm.engine.tiers.flush()
            assert llm.reset_prefix_cache()
        assert out.num_cached_tokens > 0
        assert tier_stats(llm)["redis"]["state"] == "up"
        llm.engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_write_through_stores_blocks_hit_k_times(backend, reference):
    """``write_through_selective`` (k=2): a block computed once is not stored; once a second
    request reuses it, it is; a later request after a reset loads it with equal outputs."""
    llm = make_llm(prefix_cache=backend, kv_tiers=["host:256MiB:write_through_selective?k=2"])
    host = llm.engine.tiers.stack[0]
    p = PROMPTS[0]
    first = llm.generate([p], PARAMS)[0]
    check_same(first, reference[tuple(p)])
    assert len(host) == 0, "stored before any hit"
    second = llm.generate([p], PARAMS)[0]
    assert second.num_cached_tokens > 0 and len(host) > 0
    assert llm.reset_prefix_cache()
    third = llm.generate([p], PARAMS)[0]
    check_same(third, reference[tuple(p)])
    assert third.num_cached_tokens >= len(host) * 16 > 0
    llm.engine.close()


def step_all(engine, prompts) -> list:
    """Add ``prompts`` together (one batch: their loads race) and step until all finish."""
    ids = [engine.add_request(p, PARAMS).request_id for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [final[i] for i in ids]


@pytest.mark.parametrize("backend", BACKENDS)
def test_racing_loads_of_the_same_blocks_leave_no_record(backend, reference, monkeypatch):
    """Two requests that load the same blocks in one step leave nothing in the connector's
    record of loaded blocks, whether their step commits or fails (a failed step's loads are
    dropped when a later step loads). A host tier loads on the engine thread, so both load
    while the step is scheduled."""
    llm = make_llm(prefix_cache=backend, kv_tiers=["host:64MiB:write_through"])
    engine, p, q = llm.engine, PROMPTS[0], PROMPTS[2]
    run_all(llm, reference, [p, q])  # both stored in the host tier (write-through)
    assert llm.reset_prefix_cache()
    for out in step_all(engine, [p, p]):
        check_same(out, reference[tuple(p)])
    blocks = (len(p) - 1) // 16
    assert engine.tiers.blocks_loaded == 2 * blocks and engine.tiers._loaded_from == {}

    assert llm.reset_prefix_cache()
    real = engine.runner.execute
    calls = {"n": 0}

    def fails_once(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", fails_once)
    loaded = engine.tiers.blocks_loaded
    assert [o.finish_reason for o in step_all(engine, [p, p])] == ["error", "error"]
    assert engine.tiers.blocks_loaded == loaded + 2 * blocks
    assert len(engine.tiers._loaded_from) == blocks  # loaded, never indexed
    run_all(llm, reference, [prompt(7)])  # commits, loads nothing
    check_same(step_all(engine, [q])[0], reference[tuple(q)])  # loads: the failed step's record goes
    assert engine.tiers._loaded_from == {}
    llm.engine.close()


def test_cache_events_name_the_tier_as_medium(reference):
    """A block written to a tier is announced with the tier's medium, and one the tier drops
    by its own eviction is announced removed from it: a router credits a replica per tier."""
    from kvmosaic.cache.events import BlockRemoved, BlockStored

    llm = make_llm(prefix_cache="hash", kv_tiers=["host:1MiB:write_through"], enable_kv_events=True)
    llm.generate([PROMPTS[0]], PARAMS)
    events, _ = llm.engine.events.drain()
    medium = llm.engine.pool.medium
    assert medium == ("GPU" if llm.engine.device.type == "cuda" else "CPU")  # vLLM's names
    pool = {e.block_hashes[0] for e in events if isinstance(e, BlockStored) and e.medium == medium}
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]
    assert pool and {e.block_hashes[0] for e in host} == pool
    assert all(len(e.token_ids) == 16 for e in host)
    # A 1 MiB host tier holds 2 blocks of ~368 KB: more prompts make it evict, and say so.
    llm.generate([prompt(7), prompt(8)], PARAMS)
    events, _ = llm.engine.events.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "host"]
    assert removed and len(llm.engine.tiers.stack[0]) <= 2
    llm.engine.close()


def test_segments_survive_a_restart_through_the_disk_tier(tmp_path):
    """Segment reuse uses the tier stack too: segments computed by engine A are found by
    engine B on the same disk directory, in another order."""
    from tests.test_blend_engine import DOCS, HEAD, TAIL

    spec = f"disk:{tmp_path}:256MiB"
    params = SamplingParams(temperature=0.0, max_tokens=3)
    a = make_llm(segment_reuse="shift", kv_tiers=[spec])
    first = a.generate({"prompt": HEAD, "segments": DOCS, "suffix": TAIL}, params)[0]
    assert first.num_segment_tokens == 0
    a.engine.close()
    del a
    gc.collect()
    b = make_llm(segment_reuse="shift", kv_tiers=[spec])
    again = b.generate({"prompt": HEAD, "segments": DOCS[::-1], "suffix": TAIL}, params)[0]
    assert again.num_segment_tokens > 0 and b.engine.segment_reuse.store.tier_loads == len(DOCS)
    b.engine.close()
