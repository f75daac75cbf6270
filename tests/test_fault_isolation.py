"""Issue 14, fast: one bad request never hurts anyone else.

Tiny temperatures are greedy; NaN logits in one row fail that row's request alone; a request
whose output processing, segment reuse (blend) or storage-tier load raises fails alone (the
rest of the batch finishes with the output it would have had alone) and frees its blocks; a
failed forward pass fails its batch and the engine keeps serving; a draining server answers 503
with Retry-After on generation and on the readiness probe ``/health`` while ``/health/live``
stays 200; a prompt far over the context is refused before it is tokenised. The slow suite
against a real process is tests/test_reliability.py.

Kept fast (a shared machine): one module engine with one torch thread, short prompts, a few
tokens per request (the injected output fault fires at the 3rd token, so 5 are enough).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from kvmosaic.engine.llm_engine import LLMEngine
from kvmosaic.engine.sampler import SamplingError, sample_rows, top_logprobs
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.kv.connector import KVConnector
from kvmosaic.server.app import build_app
from kvmosaic.server.async_engine import AsyncEngine
from kvmosaic.server.errors import APIError
from kvmosaic.server.metrics import ServerMetrics
from kvmosaic.server.protocol import CompletionRequest
from kvmosaic.server.serving import sampling_params

CONTEXT = 256
PROMPTS = ["The capital of France is", "One, two, three, four,", "Water boils at", "The opposite of hot is"]
POISON = "<<poison>>"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=CONTEXT, num_threads=1)


def run_all(engine: LLMEngine, prompts: list, params: SamplingParams) -> list:
    ids = [engine.add_request(p, params).request_id for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, object]:
    return dict(zip(prompts, run_all(engine, prompts, params)))


def assert_idle(engine: LLMEngine) -> None:
    st = engine.get_stats()
    assert st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_blocks, st


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-39, 1e-6])
def test_tiny_temperatures_are_greedy(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 10
    params = [SamplingParams(temperature=temperature, top_p=0.5, top_k=5)] * 3
    assert params[0].greedy
    assert sample_rows(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def test_non_finite_rows_never_poison_the_batch():
    logits = torch.randn(4, 32)
    logits[1] = float("nan")  # nothing usable: that request fails
    logits[2, 5] = float("nan")  # one NaN: sampled from the rest
    logits[3, 7] = float("inf")  # +inf: that token
    params = [SamplingParams(temperature=0.8, seed=1)] * 4
    gens = [torch.Generator().manual_seed(1) for _ in range(4)]
    out = sample_rows(logits, params, gens)
    assert isinstance(out[1], SamplingError)
    assert isinstance(out[0], int) and isinstance(out[2], int) and out[2] != 5 and out[3] == 7
    lps = top_logprobs(logits, out, [2] * 4)
    assert all(v == v and abs(v) != float("inf") for d in lps for v in d.values())  # JSON-safe


def test_validation_rejects_non_finite_temperature():
    for t in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            SamplingParams(temperature=t)


def test_a_tiny_temperature_request_matches_greedy_end_to_end(engine):
    greedy = run(engine, PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0))
    tiny = run(engine, PROMPTS[:2], SamplingParams(max_tokens=4, temperature=5e-324))
    assert [o.token_ids for o in tiny.values()] == [o.token_ids for o in greedy.values()]
    assert_idle(engine)


def test_a_poisoned_request_fails_alone(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = run(engine, PROMPTS, params)
    engine.outputs.fault_marker = POISON
    try:
        mixed = run(engine, PROMPTS[:2] + [POISON + " say something"] + PROMPTS[2:], params)
    finally:
        engine.outputs.fault_marker = None
    bad = mixed.pop(POISON + " say something")
    assert bad.finish_reason == "error" and bad.error_reason == "output_processing" and "injected" in bad.error
    assert {p: o.token_ids for p, o in mixed.items()} == {p: o.token_ids for p, o in alone.items()}
    assert all(o.finish_reason == "length" for o in mixed.values())
    assert_idle(engine)


def test_a_failed_forward_pass_fails_its_batch_and_the_engine_recovers(engine, monkeypatch):
    params = SamplingParams(max_tokens=3, temperature=0)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outs = run(engine, PROMPTS[:2], params)
    assert all(o.finish_reason == "error" and o.error_reason == "step" for o in outs.values())
    assert_idle(engine)
    again = run(engine, PROMPTS[:2], params)
    assert all(o.finish_reason == "length" for o in again.values())
    assert_idle(engine)


SEGMENTED = {"prompt": "Read the notes.", "segments": ["Note one: the shop opens at nine.",
                                                    "Note two: it closes at six."], "suffix": " When does it open?"}


def test_a_failed_blend_fails_its_request_alone(engine, monkeypatch):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    alone = run_all(engine, PROMPTS[:2], params)

    def boom(*a, **k):
        raise RuntimeError("simulated blend fault")
    monkeypatch.setattr(engine.config, "segment_reuse", "shift")
    monkeypatch.setattr(engine.segment_reuse.blender, "prefill", boom)
    first, bad, second = run_all(engine, [PROMPTS[0], SEGMENTED, PROMPTS[1]], params)
    assert bad.finish_reason == "error" and bad.error_reason == "segment_reuse" and "simulated blend" in bad.error
    assert [first.token_ids, second.token_ids] == [o.token_ids for o in alone]
    assert first.finish_reason == second.finish_reason == "length"
    assert_idle(engine)
    monkeypatch.undo()  # the engine keeps serving segmented prompts
    (ok,) = run_all(engine, [SEGMENTED], params)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    assert_idle(engine)


class FaultyTiers:
    """A storage tier that holds the victim's blocks and fails to load (``load``) or to write
    a loaded block into the pool (``write``)."""

    def __init__(self, keys: set, fail: str) -> None:
        self.keys, self.fail, self.hits = keys, fail, 0

    def lookup(self, hashes):
        found = [0 if h in self.keys else None for h in hashes]
        self.hits += sum(f is not None for f in found)
        return found

    def is_fast(self, tier: int) -> bool:
        return True

    def load_now(self, keys, tiers, tokens):
        if self.fail == "load":
            raise OSError("simulated tier read fault")
        return [b"payload"] * len(keys)

    def write_block(self, *args):
        raise ValueError("simulated corrupt tier payload")

    def record_hit(self, *args):
        pass


@pytest.mark.parametrize("fail", ["load", "write"])
def test_a_failed_tier_load_fails_its_request_alone(engine, monkeypatch, fail):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    victim = "Tier victim: " + "the quick brown fox jumps over the lazy dog " * 5
    alone = run_all(engine, PROMPTS[:2], params)
    engine.reset_prefix_cache()  # the victim's blocks must come from the tier, not the pool
    tiers = FaultyTiers(set(engine.cache.new_hasher().update(engine.inputs.process(victim, None).prompt_token_ids)), fail)
    assert tiers.keys
    monkeypatch.setattr(engine.cache, "tiers", tiers)
    monkeypatch.setattr(engine.scheduler, "connector", KVConnector(tiers, engine.cache.block_size))
    first, bad, second = run_all(engine, [PROMPTS[0], victim, PROMPTS[1]], params)
    assert tiers.hits, "the victim's blocks were found in the tier"
    assert bad.finish_reason == "error" and bad.error_reason == "tier_load" and "simulated" in bad.error
    assert [first.token_ids, second.token_ids] == [o.token_ids for o in alone]
    assert_idle(engine)


# ---- through the HTTP app, in process ----------------------------------------------------------

@pytest.fixture(scope="module")
def served(engine):
    aeng = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: aeng.stats, "m")
    aeng.on_finish = metrics.on_finish
    app = build_app(aeng, "m", metrics)
    aeng.start()
    yield app, aeng, metrics
    aeng.shutdown()


async def _post(app, path: str, body: dict, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body, timeout=60, **kw)


def post(app, path, body):
    return asyncio.run(_post(app, path, body))


def test_a_poisoned_request_gets_an_error_event_and_others_finish(served, engine):
    app, _, metrics = served
    engine.outputs.fault_marker = POISON

    async def both():
        good = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        return await asyncio.gather(
            _post(app, "/v1/completions", {**good, "stream": True}),
            _post(app, "/v1/completions", {**good, "prompt": POISON + " hi", "stream": True}),
            _post(app, "/v1/completions", {**good, "prompt": POISON + " hi"}),
            _post(app, "/v1/completions", good))
    try:
        ok_stream, bad_stream, bad_plain, ok_plain = asyncio.run(both())
    finally:
        engine.outputs.fault_marker = None
    events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert json.loads(events[-2])["error"]["code"] == "output_processing"
    assert bad_plain.status_code == 500 and set(bad_plain.json()["error"]) == {"message", "type", "param", "code"}
    text = "".join(json.loads(e)["choices"][0]["text"] for e in
                   (line[6:] for line in ok_stream.text.splitlines() if line.startswith("data: {")))
    assert ok_plain.status_code == 200 and ok_plain.json()["choices"][0]["text"] == text
    assert metrics.request_failures.labels("m", "output_processing")._value.get() >= 2
    assert_idle_http(app)


def assert_idle_http(app) -> None:
    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/health")).json()
    h = asyncio.run(health())
    assert h["kv"]["num_used_blocks"] == 0 and h["requests"] == {"running": 0, "waiting": 0}, h


def test_tiny_temperature_over_http_is_greedy(served):
    app, _, _ = served
    body = {"prompt": PROMPTS[1], "max_tokens": 3}
    greedy = post(app, "/v1/completions", {**body, "temperature": 0})
    tiny = post(app, "/v1/completions", {**body, "temperature": 1e-300})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_draining_refuses_new_requests_with_503(served):
    app, _, _ = served

    async def probes():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health"), await c.get("/health/live")
    app.state.drain.draining = True
    try:
        r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        ready, live = asyncio.run(probes())
    finally:
        app.state.drain.draining = False
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "server_shutting_down"
    # readiness fails (routers and Kubernetes stop sending traffic), liveness stays up (no restart mid-drain)
    assert ready.status_code == 503 and ready.headers["retry-after"] == "5" and ready.json()["status"] == "draining"
    assert ready.json()["draining"] is True and "kv" in ready.json()
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    ready, live = asyncio.run(probes())
    assert ready.status_code == 200 and ready.json()["status"] == "ok" and live.status_code == 200


def test_an_oversized_prompt_is_refused_before_tokenising(served, engine, monkeypatch):
    app, _, _ = served
    calls = []
    monkeypatch.setattr(engine.inputs, "process", lambda *a, **k: calls.append(1))
    r = post(app, "/v1/completions", {"prompt": "x" * (CONTEXT * 16 + 1)})
    assert r.status_code == 400 and "without tokenising" in r.json()["error"]["message"] and not calls
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (CONTEXT * 17)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and not calls


def test_a_request_larger_than_the_pool_is_refused():
    req = CompletionRequest(prompt="x", max_tokens=500)
    with pytest.raises(APIError) as e:
        sampling_params(req, 500, 100, 1024, None, "prompt", pool_tokens=512)
    assert e.value.status == 400 and "KV cache holds at most 512" in e.value.message
    assert sampling_params(req, None, 100, 1024, None, "prompt", pool_tokens=512).max_tokens == 412
