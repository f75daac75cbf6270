"""tools / tool_choice through the openai client against a real server started with the shipped
tool template (``--chat-template chatml-tools --enable-auto-tool-choice --tool-call-parser
hermes``), and the Hermes parser on its own (whole and streamed in every chunking).

The shipped 135M model does not call tools on its own (``auto``: it answers in text), so the
parser's ``auto`` path is checked on the text such a model writes, and end to end through the
forced choices (``required``, named), which the grammar makes deterministic.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import openai
import pytest

from kvmosaic.model.tokenizer import resolve_chat_template, with_chat_template
from kvmosaic.server.errors import APIError
from kvmosaic.server.launch import ServerProcess
from kvmosaic.server.protocol import ChatCompletionRequest
from kvmosaic.server.serving import OpenAIServing
from kvmosaic.server.tools import HermesStream, forced_schema, parse_hermes, template_renders_tools

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client():
    server = ServerProcess("--chat-template", "chatml-tools", "--enable-auto-tool-choice", "--tool-call-parser",
                           "hermes", "--dtype", "float32", "--max-model-len", "2048")
    with server.start():
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def create(client, **kw):
    kw = {"messages": ASK, "max_tokens": 40, "temperature": 0, **kw}
    return client.chat.completions.create(model=MODEL, **kw)


def test_named_tool_choice_calls_that_function(client):
    r = create(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)


def test_required_streamed_equals_whole(client):
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    whole = create(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    assert all(c.function.name in ("get_weather", "get_time") for c in whole.message.tool_calls)
    calls: dict[int, dict] = {}
    finish, usage = None, None
    for chunk in create(client, stream=True, stream_options={"include_usage": True}, logprobs=True, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and usage.completion_tokens > 0
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_auto_renders_tools_and_passes_text_through(client):
    plain = create(client, max_tokens=8)
    auto = create(client, tools=[WEATHER], max_tokens=8)  # tool_choice defaults to auto
    none = create(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools are in the prompt
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # none: not shown to the model
    assert auto.choices[0].finish_reason in ("stop", "length") and auto.choices[0].message.content
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_conversation_with_calls_and_results_is_accepted(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = create(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content


@pytest.mark.parametrize("kw, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
])
def test_bad_tool_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, **kw)
    assert param in str(e.value)


@pytest.fixture(scope="module")
def tokenizers(tokenizer):
    """(the shipped model's own template, the shipped tool template): one tokenizer load."""
    return tokenizer, with_chat_template(tokenizer, resolve_chat_template("chatml-tools"))


def fake_serving(tokenizer, auto: bool, parser: str | None):
    return SimpleNamespace(tokenizer=tokenizer, auto_tools=auto, tool_parser=parser, _template_tools=None)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **kw})


def test_a_template_without_tools_is_a_clear_400(tokenizers):
    own, tools = tokenizers
    assert not template_renders_tools(own)  # the shipped model's own template
    assert template_renders_tools(tools)
    with pytest.raises(APIError) as e:
        OpenAIServing.tool_session(fake_serving(own, True, "hermes"), request(tools=[WEATHER]))
    assert e.value.status == 400 and "--chat-template chatml-tools" in e.value.message
    assert OpenAIServing.tool_session(fake_serving(own, True, "hermes"), request(tools=[WEATHER],
                                                                                tool_choice="none")) is None


def test_auto_needs_the_parser_flags(tokenizers):
    serving = fake_serving(tokenizers[1], False, None)
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        OpenAIServing.tool_session(serving, request(tools=[WEATHER]))
    assert OpenAIServing.tool_session(serving, request(tools=[WEATHER], tool_choice="required")).forced


def test_required_schema_names_every_tool():
    req = request(tools=[WEATHER, TIME], tool_choice="required")
    schema = forced_schema(req.tools, req.tool_choice)
    assert schema["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]


HERMES_OUTPUTS = [
    "Just text, no call.",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}',  # not closed before EOS
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and a remark',
    "a < b and <tool_ is not a tag",
]


@pytest.mark.parametrize("text", HERMES_OUTPUTS)
def test_hermes_streamed_in_any_chunking_equals_whole(text):
    content, calls = parse_hermes(text)
    rng = random.Random(0)
    for _ in range(20):
        stream, deltas, i = HermesStream(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            deltas += stream.feed(text[i:i + n])
            i += n
        deltas += stream.finish()
        streamed = "".join(d.get("content", "") for d in deltas).strip() or None
        got = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
        assert streamed == content and got == [c["function"] for c in calls]
        assert all(json.loads(c["function"]["arguments"]) is not None for c in calls)


def test_hermes_parses_what_the_template_asks_for():
    content, calls = parse_hermes(HERMES_OUTPUTS[1])
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}
    assert parse_hermes(HERMES_OUTPUTS[4]) == (HERMES_OUTPUTS[4], [])  # not a call: kept as text
    assert parse_hermes(HERMES_OUTPUTS[5])[0] == "and a remark"
    assert len(parse_hermes(HERMES_OUTPUTS[2])[1]) == 2 and len(parse_hermes(HERMES_OUTPUTS[3])[1]) == 1
