"""Real Ray: 2 engine replicas (one thread each) behind the cache-aware router, one Serve app
shared by the module's tests.

* tenant A several times in a row, then tenant B: each tenant's requests all go to one replica
  (the header ``x-kvmosaic-replica`` names it), the second request on is a prefix hit, the
  router counts them as cache hits and predicts exactly the cached tokens the replicas report
  (this fails when the ingress cannot see the router: its /metrics then read 0 / 0);
* outputs equal a single engine's (greedy, float32);
* the router's index equals what each replica's pool holds, after the workload;
* (slow) a replica's process killed mid-run: every request is answered (the ingress retries on
  the other replica), and the dead replica leaves no index entry behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

SYSTEM = {"a": "You are a terse assistant for tenant A. Keep answers short and plain. " * 6,
          "b": "You answer as a pirate for tenant B, with nautical words in every line. " * 6}
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def cluster():
    from kvmosaic.serve.app import build_app
    from kvmosaic.server.launch import free_port

    port = free_port()
    env = pytest.MonkeyPatch()
    # the machine is shared: Ray's memory monitor must not kill the Serve controller when others
    # fill memory (seen: the controller restarted mid-test, the HTTP proxy refused connections)
    env.setenv("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"replicas": 2, "router": "cache-aware", "num_kv_blocks": NUM_KV_BLOCKS, "dtype": "float32"}),
                  name="kvmosaic", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        env.undo()


def body(tenant: str, q: str, max_tokens: int = 8) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": q}],
            "max_tokens": max_tokens, "temperature": 0}


def ask(url: str, tenant: str, q: str, max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json=body(tenant, q, max_tokens), timeout=300)
    assert r.status_code == 200, r.text
    return r


def metric(text: str, name: str, **labels: str) -> float:
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def router_state(url: str, pools: bool = False) -> dict:
    return httpx.get(url + "/router/state", params={"pools": pools}, timeout=60).json()


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_stick_to_their_prefix_and_router_predicts_exactly(cluster):
    questions = [f"Question {i}?" for i in range(3)]
    out = {t: [ask(cluster, t, q) for q in questions] for t in ("a", "b")}  # A, A, A, then B, B, B
    where = {t: {r.headers["x-kvmosaic-replica"] for r in rs} for t, rs in out.items()}
    assert len(where["a"]) == 1 and len(where["b"]) == 1, where
    assert where["a"] != where["b"], "B's prefix went where A's was, with an empty replica beside it"
    for t, rs in out.items():
        assert cached(rs[0]) == 0
        assert all(cached(r) > 0 for r in rs[1:]), (t, [cached(r) for r in rs])

    text = httpx.get(cluster + "/metrics", timeout=30).text
    assert metric(text, "kvmosaic_router_decisions_total", policy="cache-aware", reason="cache_hit") >= 4, text
    assert metric(text, "kvmosaic_router_decisions_total", reason="fallback") == 0, text
    predicted = metric(text, "kvmosaic_router_predicted_cached_tokens_total")
    reported = metric(text, "kvmosaic_router_reported_cached_tokens_total")
    assert reported == sum(cached(r) for rs in out.values() for r in rs) > 0
    assert abs(predicted - reported) <= 0.05 * reported, (predicted, reported)

    # outputs equal a single engine's (same token ids as the server prefills, greedy, float32)
    from kvmosaic.engine.config import EngineConfig
    from kvmosaic.engine.llm_engine import LLMEngine
    from kvmosaic.engine.sampling_params import SamplingParams
    from kvmosaic.router.prompt_hashes import prompt_token_ids

    eng = LLMEngine(EngineConfig(num_kv_blocks=NUM_KV_BLOCKS, dtype="float32", num_threads=1))
    for t, rs in out.items():
        for q, r in zip(questions, rs, strict=True):
            eng.add_request(prompt_token_ids(eng.tokenizer, body(t, q), chat=True),
                            SamplingParams(max_tokens=8, temperature=0))
            done = []
            while eng.has_unfinished_requests():
                done += [o for o in eng.step() if o.finished]
            assert done[-1].text == r.json()["choices"][0]["message"]["content"], (t, q)

    # the router's index equals what each replica's pool holds (events may be a moment late)
    deadline = time.monotonic() + 20
    while True:
        st = router_state(cluster, pools=True)
        index = {rid: set(v["index"]) for rid, v in st["replicas"].items()}
        pools = {rid: set(h) for rid, h in st["pools"].items()}
        if (index == pools and len(pools) == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(pools) == 2 and all(pools.values()), st["pids"]
    assert index == pools
    assert all(v["fresh"] and v["gaps"] == 0 for v in st["replicas"].values())


@pytest.mark.slow
def test_killed_replica_loses_no_request_and_leaves_the_index(cluster):
    ask(cluster, "a", "warm up")  # A's replica is the victim: it holds A's prefix, A's requests go there
    victim_rid = ask(cluster, "a", "where?").headers["x-kvmosaic-replica"]
    st = router_state(cluster)
    victim_pid = st["pids"][victim_rid]
    assert victim_pid != os.getpid() and st["replicas"][victim_rid]["index"]

    results: list[httpx.Response | Exception] = []
    streams: list[dict] = []
    where: list[str] = []

    def client(i: int) -> None:
        try:
            results.append(httpx.post(cluster + "/v1/chat/completions", json=body("a", f"Item {i}?", 16), timeout=300))
        except Exception as e:  # noqa: BLE001 - counted as a lost request
            results.append(e)

    def streamer(i: int) -> None:
        done, error, cut, finish = False, None, None, None
        try:
            with httpx.stream("POST", cluster + "/v1/chat/completions", timeout=300,
                              json={**body("a", f"Stream {i}?", 200), "stream": True, "ignore_eos": True}) as r:
                where.append(r.headers.get("x-kvmosaic-replica"))
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        error = ev.get("error", error)
                        finish = next((c["finish_reason"] for c in ev.get("choices", []) if c["finish_reason"]), finish)
        except Exception as e:  # noqa: BLE001 - a silent cut
            cut = repr(e)
        streams.append({"done": done, "error": error, "cut": cut, "finish": finish})

    threads = [threading.Thread(target=streamer, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while (victim_rid not in where or router_state(cluster)["inflight"].get(victim_rid, 0) < 4) \
            and time.monotonic() < deadline:
        time.sleep(0.05)  # kill while requests, a stream among them, are on the victim
    os.kill(victim_pid, signal.SIGKILL)
    for th in threads:
        th.join(timeout=300)
    assert len(results) == 24 and len(streams) == 8
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
    retried = [r for r in results if int(r.headers["x-kvmosaic-attempts"]) > 1]
    assert retried, "no request was on the victim when it died"
    assert all(r.headers["x-kvmosaic-replica"] != victim_rid for r in retried)
    # a stream either finished or ended with an explicit error event, then [DONE]: never silently
    assert all(s["cut"] is None and s["done"] for s in streams), streams
    assert all((s["error"] is None) == (s["finish"] == "length") for s in streams), streams
    assert all(s["error"] is None or s["error"]["code"] == "replica_failed" for s in streams), streams
    assert any(s["error"] for s in streams), ("no stream was on the victim when it died", victim_rid, where)
    print(f"\nreplica SIGKILLed with 32 requests: {len(retried)} of 24 non-streamed retried elsewhere, 0 lost; "
          f"{sum(s['error'] is not None for s in streams)} of 8 streams ended with an explicit error, 0 silently")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = router_state(cluster)
        if victim_rid not in st["replicas"] and victim_rid not in st["pids"]:
            break
        time.sleep(0.5)
    assert victim_rid not in st["replicas"], "the dead replica's index entries are still there"
    assert victim_rid not in st["pids"]
    r = ask(cluster, "a", "after the kill")  # and the cluster still answers
    assert r.headers["x-kvmosaic-replica"] != victim_rid
