"""The server against the official ``openai`` client, over loopback: completions, chat,
streaming, cached tokens, tenant isolation, cache events, metrics, disconnects and many
concurrent streams; each test on one real process and again through ``--replicas 2`` (Ray
Serve), where it applies: one product at any scale."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import httpx
import openai
import pytest

from kvmosaic.server.events import AllBlocksCleared, BlockStored, CachedBlocks, KVEventSubscriber
from kvmosaic.server.launch import ServerProcess, free_port

BLOCK = 16
SYSTEM = ("You are a helpful assistant for a hardware store. Answer briefly and politely. "
          "Opening hours are nine to six, Monday to Saturday. Returns are accepted for thirty days. ") * 2


@pytest.fixture(scope="module", params=[None, 2], ids=["one-process", "replicas-2"])
def server(request):
    events, replay = free_port(), free_port()
    args = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "1024",
            "--block-size", str(BLOCK), "--api-key-salt", "test-secret"]
    if request.param:
        args += ["--replicas", str(request.param)]
    else:
        args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
    proc = ServerProcess(*args)
    proc.replicas = request.param
    proc.events = f"tcp://127.0.0.1:{events}"
    proc.replay = f"tcp://127.0.0.1:{replay}"
    with proc.start():
        yield proc


def client(server, key: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def unique(text: str) -> str:
    """A prompt no earlier test can have cached."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def used_blocks(server) -> int:
    return sum(h["kv"]["num_used_blocks"] for h in server.pool_healths())


def wait_idle(server, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        h = server.pool_healths()
        if all(x["kv"]["num_used_blocks"] == 0 and x["requests"] == {"running": 0, "waiting": 0} for x in h):
            return h
        assert time.monotonic() < deadline, f"the pool did not return to idle: {h}"
        time.sleep(0.2)


def test_banner_says_how_to_send_a_request(server):
    deadline = time.monotonic() + 30  # replicas: the driver prints once Serve says the app is up
    while "Send it a request" not in (out := server.output()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"curl {server.url}/v1/chat/completions" in out
    assert f'OpenAI(base_url="{server.url}/v1"' in out


def test_models(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_vllm_utility_routes_and_several_choices(server):
    """Issue 21: /v1/models/{id}, /tokenize, /detokenize, /version, /ping, and n x prompts,
    on one server and through the replicas' front alike."""
    c = client(server)
    assert c.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert tok["count"] == 2
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json() == \
        {"prompt": "Hello world"}
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]
    assert httpx.get(server.url + "/ping", timeout=30).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=30).status_code == 200
    out = c.completions.create(model="SmolLM2-135M-Instruct", prompt=[unique("Red, green,"), unique("One, two,")],
                               n=2, max_tokens=3, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 12
    assert out.choices[0].text == out.choices[1].text and out.choices[2].text == out.choices[3].text
    wait_idle(server)


def test_completion_and_its_stream_agree(server):
    c, prompt = client(server), unique("A lesson about colour and paint. " * 6 + "The three primary colours are")
    full = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0)
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_chat_and_its_stream_agree(server):
    c = client(server)
    messages = [{"role": "user", "content": unique("Name a fruit.")}]
    full = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_cached_tokens_rise_on_a_shared_prefix(server):
    c, system = client(server), unique(SYSTEM)
    first, second = (c.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("When do you open?", "Can I return a drill?"))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    shared = second.usage.prompt_tokens_details.cached_tokens
    assert shared >= first.usage.prompt_tokens - 2 * BLOCK - 10 and shared % BLOCK == 0


def test_salts_isolate_tenants(server):
    prompt = unique(SYSTEM)

    def cached(key: str, salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt else None
        r = client(server, key).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1,
                                                   extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0, "another API key is another namespace"
    assert cached("bob", salt="x") == 0, "a body salt subdivides a tenant's namespace"
    assert cached("bob", salt="x") > 0
    assert cached("alice", salt="x") == 0, "the same body salt under another key is not shared"


def test_cache_events_follow_the_pool(server):
    if server.replicas:
        pytest.skip("replicas publish on their own loopback endpoints, for the router (tests/router)")
    sub = KVEventSubscriber(server.events, replay_endpoint=server.replay)
    try:
        time.sleep(0.5)  # PUB/SUB: a subscriber sees only what is sent after it joined
        ids = [1000 + (uuid.uuid4().int >> (i * 4)) % 40000 for i in range(2 * BLOCK + 5)]
        client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=2)
        by_tokens, view = {}, CachedBlocks()
        while len(by_tokens) < 2:
            seq, batch = sub.recv(timeout=20)
            view.apply(batch)
            for e in batch.events:
                if isinstance(e, BlockStored) and e.token_ids in (ids[:BLOCK], ids[BLOCK:2 * BLOCK]):
                    by_tokens[tuple(e.token_ids)] = e
        first, second = by_tokens[tuple(ids[:BLOCK])], by_tokens[tuple(ids[BLOCK:2 * BLOCK])]
        assert second.parent_block_hash == first.block_hashes[0] and second.block_size == BLOCK
        assert view.prefix_hits([first.block_hashes[0], second.block_hashes[0]]) == 2
        wait_idle(server)
        assert httpx.post(server.url + "/reset_prefix_cache", headers={"Authorization": "Bearer a"}).json() == \
            {"reset": True}
        while True:
            seq, batch = sub.recv(timeout=20)
            view.apply(batch)
            if any(isinstance(e, AllBlocksCleared) for e in batch.events):
                break
        assert len(view) == 0 and sub.gaps == 0
        replayed = sub.replay(0)
        assert [s for s, _ in replayed] == list(range(len(replayed))) and replayed[-1][0] == seq
    finally:
        sub.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum over every sample of ``name`` with these labels (one per replica, with replicas)."""
    sel = "".join(f'.*{k}="{v}"' for k, v in labels.items())
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{{sel}.*}} (\S+)$", text, re.M))


def test_metrics_use_vllm_names(server):
    before = httpx.get(server.url + "/metrics").text
    client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=unique("One two"), max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "kv_cache_usage_perc",
                 "num_requests_running", "num_requests_waiting", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "e2e_request_latency_seconds_count"):
        assert f"kvmosaic:{name}{{" in text, name
    assert metric(text, "kvmosaic:generation_tokens_total") - metric(before, "kvmosaic:generation_tokens_total") >= 3
    assert metric(text, "kvmosaic:request_success_total", finished_reason="length") > \
        metric(before, "kvmosaic:request_success_total", finished_reason="length")
    assert metric(text, "kvmosaic:prefix_cache_hits_total") <= metric(text, "kvmosaic:prefix_cache_queries_total")


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    wait_idle(server)
    aborted = metric(httpx.get(server.url + "/metrics").text, "kvmosaic:request_success_total",
                     finished_reason="abort")
    body = {"prompt": unique(SYSTEM), "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        assert used_blocks(server) > 0, "the request is running"
        r.close()  # the client goes away mid-stream
    # 900 tokens would take far longer than this wait: only an abort frees the blocks in time.
    wait_idle(server, timeout=20)
    assert metric(httpx.get(server.url + "/metrics").text, "kvmosaic:request_success_total",
                  finished_reason="abort") == aborted + 1


def test_32_concurrent_streams_complete_and_leave_the_pool_idle(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=6, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"Client {i}: name an animal."}])
        text, finish, usage = "", None, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
            usage = ch.usage or usage
        return text, finish, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert all(finish in ("stop", "length") and 1 <= n <= 6 for _, finish, n in results)
    assert sum(bool(text) for text, _, _ in results) >= 28  # an immediate EOS leaves a few empty
    wait_idle(server)
