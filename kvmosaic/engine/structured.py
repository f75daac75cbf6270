"""Structured output by a token grammar: JSON (any object, or one matching a JSON schema), and
vLLM's ``structured_outputs``: a regular expression, one of a list of strings, a Lark grammar.

The grammar library is llguidance (the ``structured`` extra; CPU, Rust): a per-request
``LLMatcher`` follows the tokens sampled so far and gives, before each sample, the bitmask of
the tokens that keep the output a prefix of a valid document. Invariants:

* a request with a grammar samples only tokens its mask allows, greedy included (the mask is
  applied to its logits row before sampling, batched over the rows that have one);
* the grammar is compiled before the request is queued (by the server on a worker thread, or
  by ``add_processed``); a schema the library refuses is a ``ValueError`` (a 400), changing
  nothing;
* when the grammar is complete (EOS allowed and taken, or nothing more can follow) the request
  finishes with ``stop``; ``max_tokens`` can still cut a document short (``length``), as in vLLM;
* a forked sample (``n > 1``) gets a copy of its parent's matcher, taken before the parent
  consumes its first token.

The tokenizer's llguidance view is built once per engine, on the first structured request
(about a second).
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

from .sampling_params import StructuredOutputs

MISSING = ("structured output (response_format, structured_outputs) needs llguidance: "
           "pip install 'kvmosaic[structured]'")


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarFactory:
    """Compiles grammars (``StructuredOutputs``) into fresh matchers for one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputs | dict | str) -> Any:
        """A matcher at the start of an output that follows ``spec`` (a JSON schema given alone is
        ``StructuredOutputs(json=...)``; ``{"type": "object"}``: any JSON object). Raises ValueError
        for what llguidance cannot compile. Thread-safe: the server compiles on a worker thread,
        so that neither the tokenizer's conversion (once, ~0.4 s) nor a large grammar's
        compilation stalls the engine's steps."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ValueError(MISSING) from None
        spec = spec if isinstance(spec, StructuredOutputs) else StructuredOutputs(json=spec)
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
        what, grammar = _grammar(llguidance.LLMatcher, spec)
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{what} cannot be used: {m.get_error()}")
        return m


def _grammar(lib: Any, spec: StructuredOutputs) -> tuple[str, str]:
    """(what it is, for messages; llguidance's grammar of it)."""
    if spec.regex is not None:
        return "structured_outputs: the regex", lib.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # one rule, each choice a literal (JSON string escapes are Lark's)
        return "structured_outputs: the choice", lib.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    if spec.grammar is not None:
        return "structured_outputs: the grammar", lib.grammar_from_lark(spec.grammar)
    schema = {"type": "object"} if spec.json_object else spec.json
    try:
        return "the JSON schema", lib.grammar_from_json_schema(
            schema if isinstance(schema, str) else json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid: {e}") from None


_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # byte -> its 8 bits, LSB first


def apply_grammars(logits: torch.Tensor, matchers: list[Any | None]) -> torch.Tensor:
    """``logits`` with each row that has a matcher masked to its allowed tokens (a new
    tensor), or ``logits`` itself when no row has one."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    assert sys.byteorder == "little", "the bitmask is unpacked bytewise (little-endian)"
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bits = torch.zeros(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        v = bits[j]
        matchers[i].unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
    # Token 32w + i is bit i of word w; on a little-endian machine that is bit i % 8 of byte
    # 4w + i // 8, so one table lookup per byte unpacks the mask.
    allowed = _BYTE_BITS[bits.view(torch.uint8).long()].reshape(len(rows), words * 32)[:, :vocab]
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out
