"""Prompts with marked segments: ``{"prompt": head, "segments": [doc, ...], "suffix": tail}``.

Each piece is tokenized on its own and the ids are concatenated, so a document always has
the same token ids wherever it appears (tokenizing the joined text could merge tokens across
a boundary). The prompt text is ``head + docs + suffix``.
"""

from __future__ import annotations

from dataclasses import dataclass

SEGMENT_FIELDS = {"prompt", "segments", "suffix", "cache_salt"}


@dataclass(frozen=True)
class SegmentSpan:
    """Tokens ``start .. end-1`` of the prompt are one segment."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SegmentedPrompt:
    text: str
    token_ids: list[int]
    spans: tuple[SegmentSpan, ...]
    cache_salt: str | None


def _encode(tokenizer, piece, what: str) -> list[int]:
    if isinstance(piece, str):
        return tokenizer.encode(piece, add_special_tokens=False) if piece else []
    raise ValueError(f"{what} must be a string")


def split_on_separator(text: str, separator: str) -> dict | None:
    """``head SEP doc SEP doc SEP tail`` as a segmented prompt dict (separators dropped), or
    None when ``text`` has no separator."""
    if separator not in text:
        return None
    pieces = text.split(separator)
    return {"prompt": pieces[0], "segments": pieces[1:-1], "suffix": pieces[-1]}


def parse_segment_prompt(tokenizer, prompt: dict) -> SegmentedPrompt:
    """Validate and tokenize a segmented prompt; empty segments are dropped."""
    unknown = set(prompt) - SEGMENT_FIELDS
    if unknown:
        raise ValueError(f"unknown prompt fields: {sorted(unknown)}")
    docs = prompt["segments"]
    if not isinstance(docs, (list, tuple)):
        raise ValueError("segments must be a list of strings")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    head, tail = prompt.get("prompt", ""), prompt.get("suffix", "")
    ids = _encode(tokenizer, head, "prompt")
    spans = []
    for doc in docs:
        doc_ids = _encode(tokenizer, doc, "each segment")
        if doc_ids:
            spans.append(SegmentSpan(len(ids), len(ids) + len(doc_ids)))
            ids += doc_ids
    ids += _encode(tokenizer, tail, "suffix")
    return SegmentedPrompt(head + "".join(docs) + tail, ids, tuple(spans), salt)
