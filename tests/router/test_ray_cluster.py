"""A real two-node Ray cluster on this machine (two ``ray start`` nodes, one CPU each), a real
redis-server, and ``kvmosaic serve --replicas 2 --ray-address ... --max-replicas-per-node 1
--kv-tier redis://...``:

* the two replicas run on different Ray nodes (each replica's process descends from a
  different raylet, one per ``ray start``);
* a prompt computed on one replica is later served by the other with cached tokens loaded from
  Redis, and the router predicted exactly those tokens for it (the shared-tier credit of
  ``router/index.py``): the request goes there because the first replica is busy with a long
  request, and it would be predicted 0 cached tokens without the credit;
* nothing of the cluster is left behind. The machine is shared (other Ray clusters may run
  beside this one), so the test never runs ``ray stop`` (it stops every Ray on the machine):
  each ``ray start`` runs in a session of its own, and every process of those sessions is
  ended by its pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
redis = pytest.importorskip("redis", reason="the 'tiers' extra (redis-py) is not installed")

from kvmosaic.server.launch import ServerProcess, free_port  # noqa: E402
from kvmosaic.tiers.redis_server import RedisServer, find_redis_server  # noqa: E402

if find_redis_server() is None:
    pytest.fail("no redis-server binary found: run scripts/setup.sh", pytrace=False)

RAY = str(Path(sys.executable).parent / "ray")
SYSTEM = "You are a careful assistant for the shared-tier test. Answer briefly and plainly. " * 8
OTHER = "You answer every question about the weather in one line, no more. " * 4
LONG = " ".join(f"item{i} is listed here" for i in range(120))  # a long, uncached user turn


def body(system: str, q: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def ask(url: str, system: str, q: str) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json=body(system, q), timeout=120)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


# ---- the cluster: two `ray start` nodes, each in its own session ---------------------------------
def session_pids(sids: set[int]) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) in sids:
                    out.append(int(entry))
    return out


def end_sessions(sids: set[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM every process of ``sids``, then SIGKILL what is left; returns the survivors."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid in session_pids(sids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + wait
        while session_pids(sids) and time.monotonic() < end:
            time.sleep(0.2)
    return session_pids(sids)


def ray_start(*args: str, env: dict) -> int:
    """Run ``ray start`` in a new session; returns the session id its processes keep."""
    ports = {"--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"}
    argv = [RAY, "start", *args, "--num-cpus", "1", "--num-gpus", "0", "--node-ip-address", "127.0.0.1",
            "--object-store-memory", str(100 * 2**20), "--disable-usage-stats",
            *[a for p in sorted(ports) for a in (p, str(free_port()))]]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return proc.pid


def raylet_of(pid: int) -> int | None:
    """The raylet a Ray worker process descends from (None: not under a raylet)."""
    while pid > 1:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                return pid
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None
    return None


@pytest.fixture(scope="module")
def cluster():
    # No token auth: a head would turn it on when ~/.ray/auth_token exists (any earlier local
    # ray.init made one), while a node or driver given an explicit address never does.
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # for ``kvmosaic serve`` (the driver) too
    mp.delenv("RAY_ADDRESS", raising=False)
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    temp = tempfile.mkdtemp(prefix="kvm-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    sids: set[int] = set()
    try:
        sids.add(ray_start("--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", temp,
                           "--ray-client-server-port", str(free_port()), env=env))
        sids.add(ray_start("--address", f"127.0.0.1:{port}", env=env))
        yield f"127.0.0.1:{port}", sids
    finally:
        mp.undo()
        left = end_sessions(sids)
        with contextlib.suppress(OSError):
            subprocess.run(["rm", "-rf", temp], check=False)
        assert not left, f"Ray processes left behind: {left}"


@pytest.mark.slow  # 70 s on a quiet 2-core machine, ~3 min when shared: two Ray nodes, two engines, Redis
def test_replicas_on_two_nodes_share_blocks_through_redis(cluster):
    address, sids = cluster
    t0 = time.monotonic()
    with RedisServer() as rs:
        server = ServerProcess("--replicas", "2", "--ray-address", address, "--max-replicas-per-node", "1",
                               "--replica-cpus", "0.5", "--dtype", "float32", "--num-kv-blocks", "256",
                               "--kv-tier", rs.url, "--router", "cache-aware")
        try:
            server.start(timeout=240)
            url = server.url
            started = time.monotonic()
            deadline = time.monotonic() + 180  # /health answers once one replica serves; the
            # router learns replicas' pids from their stats when it routes (here: /health's calls)
            while httpx.get(url + "/health", timeout=60) and len(
                    pids := httpx.get(url + "/router/state", timeout=60).json()["pids"]) < 2:
                assert time.monotonic() < deadline, pids
                time.sleep(0.5)
            started = time.monotonic()

            # 1. the two replicas on different nodes: each under its own raylet, one per `ray start`
            raylets = {rid: raylet_of(pid) for rid, pid in pids.items()}
            assert None not in raylets.values() and len(set(raylets.values())) == 2, raylets
            assert {os.getsid(r) for r in raylets.values()} == sids, (raylets, sids)

            # 2. replica A computes the shared prompt; B (the emptier one) another tenant's, so
            # each has written to Redis (which is how the router learns that B has the tier)
            r1 = ask(url, SYSTEM, "First?")
            a = r1.headers["x-kvmosaic-replica"]
            assert cached(r1) == 0
            deadline = time.monotonic() + 20
            while not httpx.get(url + "/router/state", timeout=30).json()["replicas"].get(a, {}).get("index"):
                assert time.monotonic() < deadline, "the router never saw A's blocks"
                time.sleep(0.2)
            w = ask(url, OTHER, "Rain?")
            b = w.headers["x-kvmosaic-replica"]
            assert b != a and set(pids) == {a, b}
            client = redis.Redis.from_url(rs.url)
            deadline = time.monotonic() + 20
            while client.dbsize() < (len(SYSTEM) + len(OTHER)) // 4 // 16 // 2:  # write-through done
                assert time.monotonic() < deadline, client.dbsize()
                time.sleep(0.2)
            client.close()
            time.sleep(1.0)  # the replicas publish tier events at their next flush (<= 0.5 s idle)
            before = httpx.get(url + "/metrics", timeout=30).text

            # 3. A gets a long request (a cache hit for it) and is busy; meanwhile the same prompt
            # goes to B, which loads the shared prompt's blocks from Redis
            with httpx.stream("POST", url + "/v1/chat/completions", json=body(SYSTEM, LONG, 48, stream=True),
                              timeout=120) as long_req:
                assert long_req.status_code == 200 and long_req.headers["x-kvmosaic-replica"] == a
                chunks = long_req.iter_bytes()
                next(chunks)
                r2 = ask(url, SYSTEM, "Second?")
                for _ in chunks:
                    pass
            assert r2.headers["x-kvmosaic-replica"] == b
            hit = cached(r2)
            assert hit >= 4 * 16, r2.json()["usage"]

            # 4. B's tokens came from Redis, and the router predicted them
            after = httpx.get(url + "/metrics", timeout=30).text
            redis_hits = (metric(after, "kvmosaic:kv_tier_hits_total", medium="redis", replica=b)
                          - metric(before, "kvmosaic:kv_tier_hits_total", medium="redis", replica=b))
            assert redis_hits == hit, (redis_hits, hit)
            predicted = (metric(after, "kvmosaic_router_predicted_cached_tokens_total")
                         - metric(before, "kvmosaic_router_predicted_cached_tokens_total"))
            reported = (metric(after, "kvmosaic_router_reported_cached_tokens_total")
                        - metric(before, "kvmosaic_router_reported_cached_tokens_total"))
            # (the long stream reports no usage, so only B's answer is counted): B's Redis blocks
            assert predicted == reported == hit, (predicted, reported, hit)
            print(f"\nserver up in {started - t0:.1f} s, workload {time.monotonic() - started:.1f} s")
        finally:
            server.stop()
