"""Content-defined chunks of a token stream, for automatic segment reuse (issue 24).

A chunk boundary depends only on the tokens since the last *hard break*, never on a token's
position in the prompt: so the same text chunks the same way wherever it appears, and a
document retrieved in another order, or a system prompt whose first line changed, yields the
same chunks (and so the same keys in the segment index) as before.

The rule, applied left to right with a running chunk start ``s``:

* a hard break token (a chat-template special token, a blank line: a token holding one, or
  a second newline token in a row) ends the chunk *after*
  itself and resets the rolling hash (nothing before it affects a later cut);
* a soft break token (any token holding a newline) ends the chunk after itself when the
  chunk has at least ``min_tokens`` tokens, or is the first line after a hard break (a chat
  role line such as ``user\n`` is a chunk of its own, so the message after it chunks alike
  under any role);
* otherwise a gear rolling hash over the token ids (``h = (h << 1) + gear(t)`` in 32 bits, so
  the top bits depend on the last 32 tokens only, FastCDC's choice) ends the chunk when its
  top ``mask_bits`` bits are zero and the chunk has at least ``min_tokens`` tokens;
* a chunk never grows past ``max_tokens``.

The hash is reset at every cut at a line's end (hard or soft), not at other cuts: so a line
that follows a role line chunks as it does after a blank line, and after an edit (a changed
timestamp) the cuts fall in step again with the original's at the first line end or hash cut
both see (usually within a chunk).

Invariant (tested: ``tests/test_chunking.py``): for any prefix ``P`` ending in a hard break and
any tokens ``T``, ``chunk_spans(P + T)`` shifted by ``-len(P)`` equals ``chunk_spans(T)`` past
``len(P)``; chunks partition the stream. Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


def gear(token: int) -> int:
    """A fixed pseudo-random 32-bit value per token id (splitmix64's finaliser)."""
    z = (token * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & _M32


@dataclass(frozen=True)
class ChunkRule:
    """How the stream is cut; the expected chunk is about ``min_tokens + 2**mask_bits``."""

    min_tokens: int = 16
    mask_bits: int = 5
    max_tokens: int = 128
    hard: frozenset[int] = frozenset()
    soft: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("chunking needs 1 <= min_tokens <= max_tokens")
        if not 0 <= self.mask_bits <= 31:
            raise ValueError("mask_bits must be in [0, 31]")


def chunk_spans(tokens: Sequence[int], rule: ChunkRule) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` partitioning ``tokens`` into content-defined chunks."""
    spans: list[tuple[int, int]] = []
    shift = 32 - rule.mask_bits
    hard, soft = rule.hard, rule.soft
    start, h, newline, first_line = 0, 0, False, True
    for i, t in enumerate(tokens):
        h = ((h << 1) + gear(t)) & _M32
        size = i + 1 - start
        is_hard = t in hard or (newline and t in soft)  # two newline tokens in a row: a blank line
        newline = t in soft
        cut = is_hard or size >= rule.max_tokens or (newline and first_line) or (
            size >= rule.min_tokens and (newline or (h >> shift) == 0))
        if cut:
            spans.append((start, i + 1))
            start, first_line = i + 1, is_hard
            if is_hard or newline:  # a cut at a line's end: the next line hashes from a clean state
                h = 0
            if is_hard:
                newline = False
    if start < len(tokens):
        spans.append((start, len(tokens)))
    return spans


def break_tokens(texts: dict[int, str], special_ids: Collection[int]) -> tuple[frozenset, frozenset]:
    """(hard, soft) break ids of a vocabulary given as ``{id: text}``: hard = special tokens and
    tokens whose text holds a blank line; soft = other tokens holding a newline."""
    hard, soft = set(special_ids), set()
    for tok_id, text in texts.items():
        if tok_id in hard:
            continue
        if "\n\n" in text:
            hard.add(tok_id)
        elif "\n" in text:
            soft.add(tok_id)
    return frozenset(hard), frozenset(soft)
