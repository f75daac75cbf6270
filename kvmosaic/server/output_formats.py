"""What the output must follow, as the request says it: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (the engine's ``StructuredOutputs``; engine/structured.py compiles them).
Their size caps are in ``protocol.py``'s table."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ..engine.sampling_params import StructuredOutputs
from .strict import MAX_FIELDS, MAX_STOP_CHARS, StrictModel

MAX_GRAMMAR_CHARS = 1 << 16
MAX_CHOICE_STRINGS = 1024


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (``{"json_schema": {"name": ..., "schema": {...}}}``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[dict[str, Any], Field(max_length=MAX_FIELDS)] | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON schema object)")
        return self

    @property
    def output_schema(self) -> dict | None:
        """The JSON schema the output must match; None: free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema["schema"] if self.type == "json_schema" and self.json_schema else None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema), ``json_object``,
    ``regex``, ``choice`` or ``grammar`` (Lark, llguidance's dialect: vLLM's ``guidance`` backend's);
    vLLM's other options only at their defaults."""

    json_: Annotated[dict[str, Any], Field(max_length=MAX_FIELDS)] | str | None = Field(None, alias="json")
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                      Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one(self):
        for name, neutral in (("disable_any_whitespace", False), ("disable_additional_properties", False),
                              ("whitespace_pattern", None), ("structural_tag", None)):
            if getattr(self, name) != neutral:
                raise ValueError(f"structured_outputs.{name} is not supported by this server (only "
                                 f"{json.dumps(neutral)})")
        self.spec  # noqa: B018 - exactly one constraint, checked by StructuredOutputs
        return self

    @property
    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                 json_object=self.json_object)
