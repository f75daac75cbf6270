"""Structured output: JSON (any object, or one matching a JSON schema) by a token grammar.

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

MISSING = ("structured output (response_format json_object / json_schema) needs llguidance: "
           "pip install 'kvmosaic[structured]'")


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarFactory:
    """Compiles JSON-schema grammars into fresh matchers for one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def matcher(self, schema: dict | str) -> Any:
        """A matcher at the start of a document of ``schema`` (``{"type": "object"}``: any
        JSON object). Raises ValueError for a schema llguidance cannot compile. Thread-safe:
        the server compiles on a worker thread, so that neither the tokenizer's conversion
        (once, ~0.4 s) nor a large schema's compilation stalls the engine's steps."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ValueError(MISSING) from None
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema if isinstance(schema, str) else json.dumps(schema),
                defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        except ValueError as e:
            raise ValueError(f"response_format: the JSON schema is not valid: {e}") from None
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"response_format: the JSON schema cannot be used: {m.get_error()}")
        return m


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
