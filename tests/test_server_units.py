"""Server parts that need no model: streamed text deltas, tenant salts, the cache-event wire
format with its replay, and size parsing."""

from __future__ import annotations

import argparse
import sys
import time

import msgspec
import pytest

from kvmosaic.cache import events as ce
from kvmosaic.server.cli import memory_size
from kvmosaic.server.errors import APIError
from kvmosaic.server.events import (
    BlockRemoved,
    BlockStored,
    CachedBlocks,
    KVEventBatch,
    KVEventSubscriber,
    ZmqEventPublisher,
)
from kvmosaic.server.launch import ServerProcess, free_port
from kvmosaic.server.responses import TextDelta
from kvmosaic.server.tenancy import TenantPolicy


def stream(texts: list[str], stops: list[str]) -> list[str]:
    d = TextDelta(stops)
    return [d.next(t, i == len(texts) - 1) for i, t in enumerate(texts)]


def test_text_delta_holds_back_an_incomplete_character():
    assert stream(["a", "a\ufffd", "ab\u00e9", "ab\u00e9c"], []) == ["a", "", "b\u00e9", "c"]


def test_text_delta_holds_back_what_may_become_a_stop_string():
    # The engine cuts "END" from the finished text: nothing of it was sent before.
    out = stream(["x", "x E", "x EN", "x "], ["END"])
    assert "".join(out) == "x " and all("E" not in piece for piece in out)


def test_text_delta_sends_everything_at_the_end():
    assert "".join(stream(["he", "hel", "hello"], ["STOP!"])) == "hello"


def test_salts_come_from_the_key_and_cannot_be_forged():
    p = TenantPolicy(salt_secret=b"secret")
    alice, bob = p.cache_salt("alice", None), p.cache_salt("bob", None)
    assert alice != bob and len(alice) == 32
    assert p.cache_salt("bob", alice) != alice, "naming alice's salt in the body does not reach it"
    assert p.cache_salt("alice", "x") == alice + "/x"
    assert TenantPolicy().cache_salt("alice", "x") == "x"  # no secret: vLLM's behaviour


def test_api_keys_are_required_when_configured():
    p = TenantPolicy(api_keys=frozenset({"k1"}))
    assert p.authenticate("Bearer k1") == "k1"
    for header in (None, "Bearer k2", "k1", "Basic k1"):
        with pytest.raises(APIError) as e:
            p.authenticate(header)
        assert e.value.status == 401
    assert TenantPolicy().authenticate(None) is None


def test_memory_sizes():
    assert memory_size("1G") == 1 << 30 and memory_size("512MiB") == 512 << 20 and memory_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        memory_size("lots")


def stored(h: bytes, parent: bytes | None, tokens: list[int]) -> ce.BlockStored:
    return ce.BlockStored([h], parent, tokens, len(tokens))


def test_the_wire_format_is_vllms_layout():
    """An array batch of tagged event maps with every field (tests/test_events_vllm.py: vLLM decodes it)."""
    batch = KVEventBatch(1.0, [BlockStored([b"h1"], None, [1, 2], 2, None, "CPU"), BlockRemoved([b"h1"], "CPU")])
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw[0] == 1.0 and raw[2] is None
    assert raw[1] == [{"type": "BlockStored", "block_hashes": [b"h1"], "parent_block_hash": None, "token_ids": [1, 2],
                       "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": None,
                       "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None},
                      {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "CPU", "group_idx": 0}]


def test_a_subscriber_follows_the_publisher_and_replays_what_it_missed():
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(pub_ep, "kv", replay_ep)
    pub.publish([stored(b"a", None, [1, 2])])  # seq 0
    pub.publish([stored(b"b", b"a", [3, 4])])  # seq 1
    time.sleep(0.3)  # sent before anyone subscribed: lost on PUB/SUB, kept for replay
    sub = KVEventSubscriber(pub_ep, "kv", replay_endpoint=replay_ep)
    try:
        time.sleep(0.5)
        sub.next_seq = 0  # what this router has seen: nothing
        pub.publish([stored(b"c", b"b", [5, 6]), ce.BlockRemoved([b"c"])])  # seq 2
        view, seqs = CachedBlocks(), []
        while len(seqs) < 3:
            seq, batch = sub.recv(timeout=10)
            seqs.append(seq)
            view.apply(batch)
        assert seqs == [0, 1, 2] and sub.gaps == 0
        assert view.prefix_hits([b"a", b"b", b"c"]) == 2 and view.parent[b"b"] == b"a"
        pub.publish([ce.AllBlocksCleared()])
        seq, batch = sub.recv(timeout=10)
        view.apply(batch)
        assert seq == 3 and len(view) == 0
    finally:
        sub.close()
        pub.close()


HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_started_then_entered_is_one_process_and_stops():
    proc = ServerProcess()
    proc.args = [sys.executable, "-c", HEALTHY, str(proc.port)]
    started = proc.start()
    first = proc.proc
    with started:  # the fixtures' ``with proc.start():`` once started a second server and leaked this one
        assert proc.proc is first and proc.alive()
    assert first.poll() is not None


def test_launch_builds_the_engine_on_the_engine_thread_and_raises_build_errors():
    """AsyncEngine.launch builds the engine on the thread that will run it (the one thread that
    runs torch); an error while building reaches the caller."""
    import threading

    from kvmosaic.server.async_engine import AsyncEngine
    from tests.conftest import make_llm

    built_on = []

    def broken():
        built_on.append(threading.current_thread().name)
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.launch(broken)

    def working():
        built_on.append(threading.current_thread().name)
        return make_llm().engine

    aeng = AsyncEngine.launch(working)
    try:
        assert built_on == ["kvmosaic-engine", "kvmosaic-engine"]
        assert aeng._thread.is_alive() and aeng._thread is not threading.current_thread()
        aeng.start()  # already running: nothing to do
    finally:
        aeng.shutdown()
    assert not aeng._thread.is_alive()


def test_a_validation_error_message_is_short_and_built_in_linear_time():
    """Issue 25: the message named every problem, deduplicated by scanning lists (quadratic:
    17 s for 40,000 unknown fields, on the event loop). Now: the first five and a count."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    from kvmosaic.server.errors import from_validation_error

    class Open(BaseModel):  # no caps: as many errors as fields
        model_config = ConfigDict(extra="forbid")

    for n in (10_000, 80_000):
        with pytest.raises(ValidationError) as e:
            Open.model_validate({f"k{i}": 1 for i in range(n)})
        t = time.perf_counter()
        err = from_validation_error(e.value)
        elapsed = time.perf_counter() - t
        assert err.status == 400 and err.param == "k0"
        assert err.message.startswith("unknown field 'k0'; unknown field 'k1'")
        assert err.message.endswith(f"... and {n - 5:,} more") and len(err.message) < 300
        assert elapsed < 2.0, elapsed


def test_parsing_runs_off_the_event_loop_under_a_time_budget():
    """A body whose parsing takes longer than the budget gets a 413 (the late result is
    dropped); meanwhile the event loop keeps running."""
    import asyncio

    from kvmosaic.server.serving import off_loop

    def slow(x: int) -> int:
        time.sleep(0.5)
        return x

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        assert await off_loop(slow, 7, budget=2.0) == 7
        with pytest.raises(APIError) as e:
            await off_loop(slow, 8, budget=0.1)
        ticker.cancel()
        return ticks, e.value

    ticks, err = asyncio.run(main())
    assert err.status == 413 and "more than 0.1 s" in err.message
    assert ticks > 20, "the event loop ran while the work did"


def test_the_schema_caps_lengths_so_validation_is_bounded():
    from kvmosaic.server.protocol import MAX_STOP_TOKEN_IDS, ChatCompletionRequest, CompletionRequest
    from kvmosaic.server.serving import decode_and_validate

    def refused(model, body: dict) -> APIError:
        with pytest.raises(APIError) as e:
            decode_and_validate(msgspec.json.encode(body), model)
        return e.value

    e = refused(CompletionRequest, {"prompt": "x", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)})
    assert e.param == "stop_token_ids" and "at most 1024" in e.message
    e = refused(CompletionRequest, {"prompt": "x", **{f"x{i}": 1 for i in range(100)}})
    assert "101 fields" in e.message and "'x0', 'x1', 'x2', 'x3', 'x4' and 95 more" in e.message
    e = refused(CompletionRequest, {"prompt": [-1] * 50_000})  # one error (fail_fast), not 50,000
    assert e.param == "prompt" and len(e.message) < 200
    e = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}] * 5000})
    assert e.param == "messages" and "at most 4096" in e.message
    e = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]})
    assert e.param == "messages.0.content"
    e = refused(CompletionRequest, {"prompt": "x", "stop": ["s"] * 17})
    assert e.param == "stop" and "not 17" in e.message
    e = refused(CompletionRequest, {"prompt": "x", "stop": "s" * 1025})
    assert e.param == "stop"
    ok = decode_and_validate(b'{"prompt": "x", "stop": ["a", "b"], "stop_token_ids": [1, 2]}', CompletionRequest)
    assert ok.stop_list == ["a", "b"] and ok.stop_token_ids == [1, 2]


def test_tokenizer_for_reads_the_models_own_tokenizer_once_per_argument():
    """One map from ``--model`` to a tokenizer outside the engine (front, explain, benchmarks): the
    shipped GGUF's ChatML ids, the same object for None and again for None."""
    from kvmosaic.model.loader import shipped_model_path
    from kvmosaic.server.tokenizer import tokenizer_for

    tok = tokenizer_for(None)
    assert tok.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [1, 2]
    assert tokenizer_for(None) is tok
    by_path = tokenizer_for(shipped_model_path())
    assert by_path.encode("Hello there", add_special_tokens=False) == tok.encode("Hello there", add_special_tokens=False)


def test_free_ports_are_outside_the_range_the_kernel_hands_out():
    """A port from free_port is not one that a process binding port 0 (Ray starts dozens) can be
    given before the server binds it."""
    import socket

    from kvmosaic.server.launch import EPHEMERAL_RANGE, LOWEST_PORT

    low, high = (int(x) for x in open(EPHEMERAL_RANGE).read().split())
    if low <= LOWEST_PORT:
        pytest.skip(f"this kernel hands out ports from {low}: no room below")
    drawn = [free_port() for _ in range(200)]
    ports = set(drawn)
    assert len(ports) == len(drawn), "a port handed out twice: servers started together would collide"
    assert all(LOWEST_PORT <= p < low for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # and free
