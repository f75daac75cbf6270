"""Content-defined chunking (cache/chunking.py): the same text chunks the same way wherever it
appears, so automatic reuse finds it again (issue 24)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmosaic.cache.chunking import ChunkRule, break_tokens, chunk_spans

HARD, NL = 1, 198  # a special token, a newline token
RULE = ChunkRule(min_tokens=8, mask_bits=4, max_tokens=64, hard=frozenset({HARD}), soft=frozenset({NL}))
words = st.lists(st.integers(3, 5000), min_size=0, max_size=300)


def shifted(spans, by):
    return [(a + by, b + by) for a, b in spans]


@settings(max_examples=200, deadline=None)
@given(prefix=words, body=words)
def test_boundaries_are_stable_under_any_shift(prefix, body):
    """Behind any prefix ending in a hard break, a text's chunks are its chunks alone, moved."""
    head = prefix + [HARD]
    whole = chunk_spans(head + body, RULE)
    assert [s for s in whole if s[0] >= len(head)] == shifted(chunk_spans(body, RULE), len(head))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([HARD, NL, 7, 8, 9, 10, 11, 4000]), max_size=400))
def test_chunks_partition_the_stream_within_bounds(tokens):
    spans = chunk_spans(tokens, RULE)
    assert [t for a, b in spans for t in tokens[a:b]] == tokens
    assert all(a < b and b - a <= RULE.max_tokens for a, b in spans)
    for a, b in spans[:-1]:  # a chunk shorter than min_tokens ends only at a break
        assert b - a >= RULE.min_tokens or tokens[b - 1] in (HARD, NL)


def test_a_role_line_is_its_own_chunk():
    body = list(range(100, 130)) + [NL, NL]
    for role in ([50, NL], [51, 52, NL]):
        ids = [HARD] + role + body
        assert (1 + len(role), len(ids)) in chunk_spans(ids, RULE) or \
            chunk_spans(ids, RULE)[2][0] == 1 + len(role)


def test_documents_in_another_order_chunk_the_same():
    rng = random.Random(0)
    docs = [[rng.randrange(3, 5000) for _ in range(rng.randrange(40, 200))] + [NL, NL] for _ in range(5)]
    def chunks(order):
        ids = [HARD] + [t for d in order for t in d]
        return {tuple(ids[a:b]) for a, b in chunk_spans(ids, RULE)}
    a, b = chunks(docs), chunks(docs[::-1])
    assert a == b and len(a) > 5


def test_an_early_edit_leaves_later_chunks_alone():
    rng = random.Random(1)
    body = [rng.randrange(3, 5000) for _ in range(600)]
    one = [HARD, 11, 12, 13, NL, NL] + body
    two = [HARD, 11, 99, 98, 97, 13, NL, NL] + body  # the first line changed and grew
    c1 = {tuple(one[a:b]) for a, b in chunk_spans(one, RULE)}
    c2 = [tuple(two[a:b]) for a, b in chunk_spans(two, RULE)]
    shared = sum(len(c) for c in c2 if c in c1)
    assert shared >= len(body)  # every chunk after the blank line (and the first token)


def test_break_tokens_of_a_vocabulary():
    hard, soft = break_tokens({5: "a", 6: "\n", 7: "\n\n", 8: "x\ny", 9: "<s>"}, {9})
    assert hard == {7, 9} and soft == {6, 8}


def test_rule_is_validated():
    with pytest.raises(ValueError):
        ChunkRule(min_tokens=0)
    with pytest.raises(ValueError):
        ChunkRule(min_tokens=10, max_tokens=5)
