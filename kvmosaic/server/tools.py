"""Tools (function calling) for ``/v1/chat/completions``: the request's ``tools`` and
``tool_choice``, the grammar that forces a call, and the Hermes tool-call parser (vLLM's
``--tool-call-parser hermes``), whole and streamed.

How each ``tool_choice`` is honoured (vLLM's rules):

* ``none``: the tools are not given to the template; the model answers in text.
* ``auto``: the tools go to the chat template; the model may write
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, which the parser turns
  into ``tool_calls`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser hermes``).
* ``required``: the output is forced by a JSON-schema grammar (engine/structured.py) to an
  array of ``{"name": one of the tools, "parameters": its schema}`` (at least one call).
* named (``{"type": "function", "function": {"name": N}}``): the output is forced to N's
  parameters schema and becomes one call of N.

Invariants: a response with tool calls has ``finish_reason == "tool_calls"`` (unless it was
cut by ``length``); a call's ``arguments`` is always a JSON string; text that does not parse
as a call stays ``content`` (never dropped: a block that fails to parse, and all after it, is
content); a streamed response's deltas, concatenated, equal the non-streamed message (content
up to surrounding whitespace, and each call's name and arguments).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TOOL_PARSERS = ("hermes",)
MAX_TOOLS = 128
START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.S)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolList = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def params_schema(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def forced_schema(tools: list[Tool], choice: ToolChoice) -> dict | None:
    """The JSON schema that forces ``choice`` (None for ``none`` / ``auto``); vLLM's shapes, except
    that a call object of ``required`` admits no other keys (so the call ends after its
    parameters)."""
    if isinstance(choice, NamedToolChoice):
        return params_schema(next(t for t in tools if t.function.name == choice.function.name))
    if choice != "required":
        return None
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                          "parameters": params_schema(t)},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}


def forced_calls(text: str, choice: ToolChoice) -> list[dict] | None:
    """The calls a forced output holds (None when it is not complete JSON, e.g. cut by length)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, NamedToolChoice):
        return [tool_call(choice.function.name, value)]
    if isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
        return [tool_call(c["name"], c.get("parameters", {})) for c in value]
    return None


def _parse_call(body: str) -> dict | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return tool_call(value["name"], value.get("arguments", value.get("parameters", {})))


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole output: :class:`HermesStream` run over it at once,
    so a streamed response says exactly what a whole one says. Content is the text outside
    the calls, stripped (None when empty)."""
    stream = HermesStream()
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas).strip()
    return content or None, stream.calls


class HermesStream:
    """Streams one choice: content deltas until ``<tool_call>`` (a tail that could begin it is
    held back), then one ``tool_calls`` delta per completed block (name and full arguments).
    ``feed(delta)`` returns the deltas to send; ``finish()`` the rest once the output is final,
    so that what was sent equals :func:`parse_hermes` of the whole text."""

    def __init__(self) -> None:
        self.buffer = ""      # text not yet sent as content, nor parsed into a call
        self.in_calls = False
        self.calls: list[dict] = []
        self.sent_content = ""

    def feed(self, delta: str) -> list[dict]:
        self.buffer += delta
        out: list[dict] = []
        if not self.in_calls:
            i = self.buffer.find(START)
            if i < 0:
                keep = _partial_suffix(self.buffer, START)
                send, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if send:
                    self.sent_content += send
                    out.append({"content": send})
                return out
            if i:
                self.sent_content += self.buffer[:i]
                out.append({"content": self.buffer[:i]})
            self.buffer, self.in_calls = self.buffer[i:], True
        while True:  # complete blocks become calls; between them only whitespace
            self.buffer = self.buffer.lstrip()
            if self.buffer[:len(START)] != START[:len(self.buffer)]:
                return out + self._give_up()  # text after the calls: content
            end = self.buffer.find(END)
            if end < 0:
                return out
            call = _parse_call(self.buffer[len(START):end])
            if call is None:  # not a call: the rest of the output is content
                return out + self._give_up()
            self.calls.append(call)
            out.append({"tool_calls": [{"index": len(self.calls) - 1, **call}]})
            self.buffer = self.buffer[end + len(END):]

    def _give_up(self) -> list[dict]:
        self.in_calls = False
        text, self.buffer = self.buffer, ""
        self.sent_content += text
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        if self.in_calls and self.buffer.startswith(START):
            call = _parse_call(self.buffer[len(START):])  # a last block the model did not close
            if call is not None:
                self.calls.append(call)
                self.buffer = ""
                return [{"tool_calls": [{"index": len(self.calls) - 1, **call}]}]
        return self._give_up()


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows tools to the model (a probe tool's name
    appears in the rendered prompt)."""
    probe = [{"type": "function", "function": {"name": "kvmosaic_probe_tool_x7", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools cannot render them
        return False
    return "kvmosaic_probe_tool_x7" in text


class ForcedStream:
    """A forced call (``required`` / named): the JSON is held until the output is final, then
    sent as calls (or, when it is not complete JSON, e.g. cut by ``length``, as content)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice, self.text, self.calls = choice, "", []

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        return []

    def finish(self) -> list[dict]:
        self.calls = forced_calls(self.text, self.choice) or []
        if self.calls:
            return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(self.calls)]
        return [{"content": self.text}] if self.text else []


class ToolSession:
    """One chat request's tool handling: ``auto`` with a parser, or a forced choice."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.forced = choice == "required" or isinstance(choice, NamedToolChoice)

    def stream(self) -> HermesStream | ForcedStream:
        return ForcedStream(self.choice) if self.forced else HermesStream()

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        s = self.stream()
        deltas = s.feed(text) + s.finish()
        content = "".join(d.get("content", "") for d in deltas)
        return (content.strip() or None) if s.calls else content, s.calls


def finish_reason(reason: str | None, calls: list) -> str | None:
    """OpenAI's ``tool_calls`` when the output ended (not cut by length) with calls."""
    return "tool_calls" if calls and reason == "stop" else reason
