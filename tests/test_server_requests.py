"""The request surface vLLM users rely on (issue 21, part 2), against a real server with the
official ``openai`` client: SDK extras and unknown fields accepted, known-but-unsupported
fields refused naming the field, penalties / ``min_p`` / ``logit_bias`` / ``min_tokens``,
``n > 1`` (the prompt computed once), lists of prompts, structured output (``response_format``,
llguidance), and vLLM's utility endpoints. Every test ends with nothing in use."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from kvmosaic.server.launch import ServerProcess

BLOCK = 16
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
                       "--block-size", str(BLOCK)) as proc:
        yield proc


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def unique(text: str) -> str:
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if h["kv"]["num_used_blocks"] == 0 and h["requests"] == {"running": 0, "waiting": 0}:
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(f"kvmosaic:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# ---- fields ------------------------------------------------------------------------------
def test_sdk_extras_and_unknown_fields_are_accepted(server):
    c = client(server)
    out = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=USER, max_tokens=3, temperature=0, store=False,
        metadata={"team": "a"}, parallel_tool_calls=False, service_tier="auto", user="u1",
        extra_body={"skip_special_tokens": True, "chat_template_kwargs": {"enable_thinking": False, "tokenize": True,
                                                                        "continue_final_message": True},
                    "min_tokens": 1, "priority": 0, "prompt_logprobs": None, "some_future_field": {"x": 1},
                    "tool_choice": "none", "tools": []})
    assert out.choices[0].message.content and out.usage.completion_tokens == 3
    r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 2, "brand_new_knob": 7,
                                         "stream_options": None, "user": "u"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "were present in the request but ignored: 'brand_new_knob'" in server.output()
    idle(server)


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "priority": 3}, "priority"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "nonsense"}}}}, "JSON schema cannot be used"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "max_tokens": 0}, "only with echo"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a"] * 8, "n": 40}, "choices"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_known_but_unsupported_values_are_a_clear_400(server, body, field):
    if "JSON schema" in field:
        pytest.importorskip("llguidance")  # the structured extra (scripts/setup.sh installs it)
    r = httpx.post(server.url + (CHAT if "messages" in body else C), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.json()
    idle(server)


# ---- sampling ----------------------------------------------------------------------------
def complete(server, prompt: str, **kw) -> dict:
    r = httpx.post(server.url + C, json={"prompt": prompt, "temperature": 0, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_penalties_change_a_repetitive_greedy_output_and_defaults_do_not(server):
    prompt = "one two one two one two one two one two one two"
    plain = complete(server, prompt, max_tokens=12)["choices"][0]["text"]
    neutral = complete(server, prompt, max_tokens=12, presence_penalty=0, frequency_penalty=0,
                       repetition_penalty=1.0, min_p=0.0, logit_bias={}, min_tokens=0)["choices"][0]["text"]
    assert neutral == plain
    for kw in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert complete(server, prompt, max_tokens=12, **kw)["choices"][0]["text"] != plain, kw
    idle(server)


def test_logit_bias_forces_and_forbids_tokens(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": " banana"}, timeout=30).json()["tokens"]
    assert len(tok) == 1
    out = complete(server, "The sky is", max_tokens=3, logprobs=0, logit_bias={str(tok[0]): 100})
    assert out["choices"][0]["text"] == " banana" * 3
    first = complete(server, "The sky is", max_tokens=1)["choices"][0]["text"]
    first_id = httpx.post(server.url + "/tokenize", json={"prompt": first}, timeout=30).json()["tokens"][0]
    banned = complete(server, "The sky is", max_tokens=1, logit_bias={str(first_id): -100})["choices"][0]["text"]
    assert banned != first
    idle(server)


def test_min_tokens_holds_off_eos_and_min_p_keeps_only_the_top(server):
    # A chat turn the model ends at once with greedy decoding; min_tokens keeps it going.
    r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "Say only: yes"}],
                                            "temperature": 0, "max_tokens": 40}, timeout=300).json()
    short = r["usage"]["completion_tokens"]
    assert r["choices"][0]["finish_reason"] == "stop" and short < 30
    r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": "Say only: yes"}],
                                            "temperature": 0, "max_tokens": 40, "min_tokens": short + 5},
                   timeout=300).json()
    assert r["usage"]["completion_tokens"] >= short + 5
    greedy = complete(server, "The capital of France is", max_tokens=6)["choices"][0]["text"]
    for seed in (1, 2, 3):  # min_p = 1 keeps only the most likely token: sampling is greedy
        sampled = complete(server, "The capital of France is", max_tokens=6, temperature=1.5, min_p=1.0, seed=seed)
        assert sampled["choices"][0]["text"] == greedy
    idle(server)


# ---- n > 1 -------------------------------------------------------------------------------
def test_n_samples_share_one_prompt_computation(server):
    prompt = unique("A long report on the history of bridges. " * 100)
    n_prompt = len(httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"])
    assert n_prompt > 900
    before = metric(server, "prefix_cache_queries_total") - metric(server, "prefix_cache_hits_total")
    out = client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, n=8, max_tokens=6,
                                            temperature=1.0, seed=7)
    computed = metric(server, "prefix_cache_queries_total") - metric(server, "prefix_cache_hits_total") - before
    assert computed <= 1.05 * n_prompt, (computed, n_prompt)
    assert sorted(ch.index for ch in out.choices) == list(range(8))
    assert len({ch.text for ch in out.choices}) > 1  # independent samples
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 8 * 6
    again = client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, n=8, max_tokens=6,
                                              temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    idle(server)


def test_n_greedy_chat_streamed_gives_n_identical_choices(server):
    c = client(server)
    plain = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER, max_tokens=8, temperature=0,
                                       n=3, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {i: plain.choices[0].message.content for i in range(3)}
    assert set(finish) == {0, 1, 2}
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == 3 * plain.usage.completion_tokens
    idle(server)


def test_a_client_leaving_an_n_stream_frees_every_sample(server):
    body = {"prompt": unique("Tell me a story. " * 20), "n": 4, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + C, json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    idle(server)


# ---- lists of prompts --------------------------------------------------------------------
def test_a_list_of_prompts_gets_choices_in_openai_order(server, tokenizer):
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [complete(server, p, max_tokens=4)["choices"][0]["text"] for p in prompts]
    both = complete(server, prompts, max_tokens=4, n=2)
    assert [ch["index"] for ch in both["choices"]] == [0, 1, 2, 3]
    assert [ch["text"] for ch in both["choices"]] == [singles[0], singles[0], singles[1], singles[1]]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    by_ids = complete(server, ids, max_tokens=4)
    assert [ch["text"] for ch in by_ids["choices"]] == singles
    assert by_ids["usage"]["prompt_tokens"] == sum(len(x) for x in ids)
    assert by_ids["usage"]["completion_tokens"] == 8
    streamed: dict[int, str] = {}
    with httpx.stream("POST", server.url + C, json={"prompt": prompts, "max_tokens": 4, "temperature": 0,
                                                    "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert streamed == {0: singles[0], 1: singles[1]}
    idle(server)


def test_a_bad_prompt_in_a_list_refuses_the_request_and_holds_nothing(server):
    r = httpx.post(server.url + C, json={"prompt": ["fine", "word " * 3000], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    idle(server)


# ---- structured output -------------------------------------------------------------------
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]}}}


def test_json_schema_outputs_are_valid_every_time(server):
    pytest.importorskip("llguidance")  # the structured extra (scripts/setup.sh installs it)
    jsonschema = pytest.importorskip("jsonschema")
    c = client(server)
    valid = 0
    for i in range(5):  # 5 requests x n=10: 50 documents, sampled hot
        out = c.chat.completions.create(
            model="SmolLM2-135M-Instruct", n=10, max_tokens=80, temperature=1.0, seed=i,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        for ch in out.choices:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), PERSON)
            valid += 1
    assert valid == 50
    idle(server)


def test_structured_outputs_choice_regex_and_grammar(server):
    """vLLM's ``structured_outputs``: sampled hot, every output is one of the choices, matches the
    regex, parses by the grammar; a bad regex or grammar, two constraints, or one beside
    response_format is a 400 naming the field."""
    pytest.importorskip("llguidance")
    import re

    def outputs(constraint: dict, **kw) -> list[tuple[str, str]]:
        r = httpx.post(server.url + C, json={"prompt": "Answer:", "n": 8, "max_tokens": 24, "temperature": 1.0,
                                             "seed": 3, "structured_outputs": constraint, **kw}, timeout=300)
        assert r.status_code == 200, r.text
        return [(ch["text"], ch["finish_reason"]) for ch in r.json()["choices"]]

    choices = ["yes", "no", "it depends on the weather"]
    assert all(text in choices and why == "stop" for text, why in outputs({"choice": choices}))
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    assert all(re.fullmatch(date, text) and why == "stop" for text, why in outputs({"regex": date}))
    sums = 'start: num (" + " num)*\nnum: /[1-9][0-9]?/'
    for text, why in outputs({"grammar": sums}, max_tokens=40):
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", text) if why == "stop" else why == "length", text
    for body, field in (({"regex": "[0-9"}, "regex"), ({"grammar": "start: nowhere"}, "grammar"),
                        ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"structural_tag": "x"}, "structural_tag")):
        r = httpx.post(server.url + C, json={"prompt": "x", "structured_outputs": body}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + CHAT, json={"messages": USER, "structured_outputs": {"choice": ["a"]},
                                             "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400 and "give one of them" in r.json()["error"]["message"]
    idle(server)


def test_json_object_mode_streamed(server):
    pytest.importorskip("llguidance")
    text = ""
    with httpx.stream("POST", server.url + C, timeout=300, json={
            "prompt": "A JSON object describing a cat:", "max_tokens": 120, "temperature": 0.7, "seed": 3,
            "response_format": {"type": "json_object"}, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert isinstance(json.loads(text), dict)
    idle(server)


# ---- utility endpoints -------------------------------------------------------------------
def test_tokenize_detokenize_version_ping_and_model(server, tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048
    chat = httpx.post(server.url + "/tokenize", json={"messages": USER}, timeout=30).json()
    assert chat["count"] > r["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**8]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={}, timeout=30).status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    m = client(server).models.retrieve("SmolLM2-135M-Instruct")
    assert m.id == "SmolLM2-135M-Instruct" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client(server).models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
