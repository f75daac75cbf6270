"""The request models' base (server/protocol.py): strict types, unknown keys kept aside and
ignored, and an object with more than ``MAX_FIELDS`` keys refused in one error (protocol.py's cap
table says why)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

MAX_FIELDS = 64
MAX_STOP_CHARS = 1024  # characters of a stop string (and of a structured_outputs choice)
NAMED_UNKNOWN = 5  # unknown fields named in the message when an object has too many fields


def short_repr(name: object, limit: int = 64) -> str:
    text = repr(name)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


class StrictModel(BaseModel):
    """Types are strict; unknown keys are kept aside (``model_extra``) and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _bounded_fields(cls, data):
        """An object with more keys than ``MAX_FIELDS`` is refused whole, in one error (the
        alternative, one ``extra_forbidden`` error per key, costs per key)."""
        if isinstance(data, dict) and len(data) > MAX_FIELDS:
            unknown = [k for k in data if k not in cls.model_fields]
            named = ", ".join(short_repr(k) for k in unknown[:NAMED_UNKNOWN])
            more = f" and {len(unknown) - NAMED_UNKNOWN:,} more" if len(unknown) > NAMED_UNKNOWN else ""
            raise ValueError(f"the object has {len(data):,} fields; at most {MAX_FIELDS} are accepted "
                             f"(unknown fields: {named}{more})")
        return data
