"""The shadow audit of automatic reuse (``auto_reuse_audit_rate``, kvmosaic/blend/shadow.py): an
answer from reused KV measured against a full prefill, off the first token's path; and the breaker
that turns reuse off for a namespace whose audits drift (kvmosaic/blend/breaker.py). float32."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvmosaic.blend import breaker, shadow
from kvmosaic.blend.shadow import AuditStats, ShadowAudit, kl_to_full
from kvmosaic.engine import llm_engine
from kvmosaic.engine.llm import LLM
from kvmosaic.engine.sampler import sample_rows
from kvmosaic.engine.sampling_params import SamplingParams
from tests.test_auto_reuse import DOCS, GREEDY, text


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, segment_cache_memory=128 << 20, segment_reuse="auto",
               auto_reuse_max_drift=0.1, auto_reuse_audit_rate=1.0)


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", num_kv_blocks=256)


def drawn_logits(llm, prompt, params=GREEDY):
    """The logits rows a request's tokens were drawn from, as the engine handed them to its sampler (one
    request alone, no logits processor), and the request's output."""
    rows = []

    def keep(logits, *args, **kwargs):
        rows.append(logits[-1].clone())
        return sample_rows(logits, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "sample_rows", keep)
        out = llm.generate(prompt, params)[0]
    return rows, out


def first_logits(llm, prompt):
    """The logits row a request's first token is drawn from, and the request's output."""
    rows, out = drawn_logits(llm, prompt)
    return rows[0], out


def reused(llm, rate=1.0, bound=None):
    """Documents in order, then reversed (the second found in the store), from an empty store and cache."""
    e = llm.engine
    e.config.auto_reuse_audit_rate, e.config.auto_reuse_audit_bound = rate, bound
    e.segment_reuse.store.clear()
    assert e.reset_prefix_cache()
    llm.generate(text(DOCS), GREEDY)
    return first_logits(llm, text(DOCS[::-1]))


def test_an_audit_measures_the_answers_kl_to_an_ordinary_prefill(llm, plain):
    """The KL the audit counts is the one between the distribution the reused answer was drawn from and the
    one another engine's ordinary prefill of the same prompt gives (no blend code on that side)."""
    before = llm.engine.get_stats()
    answered, out = reused(llm)
    assert out.auto_reuse["tokens"] > 0 and not out.auto_reuse["fallback"]
    assert plain.engine.reset_prefix_cache()
    full, _ = first_logits(plain, text(DOCS[::-1]))
    want = float(torch.nn.functional.kl_div(answered.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                            reduction="sum"))
    st = llm.engine.get_stats()
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1
    measured = st.auto_reuse_audit_kl["sum"] - (before.auto_reuse_audit_kl or {"sum": 0.0})["sum"]
    assert want > 1e-4  # the documents moved: the answer drifted a little
    assert measured == pytest.approx(want, rel=1e-3, abs=1e-6)
    assert sum(st.auto_reuse_audit_kl["counts"]) == st.auto_reuse_audits
    assert st.kv_cache_usage == 0 and not llm.engine.segment_reuse.has_pending


def test_an_audit_never_changes_an_answer_nor_the_caches(llm):
    logits_off, off = reused(llm, rate=0.0)
    entries = len(llm.engine.segment_reuse.store.index)
    blocks = llm.engine.get_stats().num_cached_blocks
    audits = llm.engine.get_stats().auto_reuse_audits
    logits_on, on = reused(llm, rate=1.0)
    assert llm.engine.get_stats().auto_reuse_audits == audits + 1
    assert on.token_ids == off.token_ids and on.logprobs == off.logprobs and on.auto_reuse == off.auto_reuse
    assert torch.equal(logits_on, logits_off)
    assert len(llm.engine.segment_reuse.store.index) == entries
    assert llm.engine.get_stats().num_cached_blocks == blocks


def test_the_bound_counts_audited_answers_over_it(llm):
    st = llm.engine.get_stats()
    reused(llm, bound=0.0)  # any drift is over
    mid = llm.engine.get_stats()
    assert mid.auto_reuse_audits_over_bound == st.auto_reuse_audits_over_bound + 1
    reused(llm, bound=10.0)
    after = llm.engine.get_stats()
    assert after.auto_reuse_audits == mid.auto_reuse_audits + 1
    assert after.auto_reuse_audits_over_bound == mid.auto_reuse_audits_over_bound


def test_a_failed_audit_is_counted_and_costs_nothing_else(llm, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory for the scratch buffer")

    monkeypatch.setattr(shadow, "prefill_piece", broken)
    before = llm.engine.get_stats()
    _, out = reused(llm)
    st = llm.engine.get_stats()
    assert out.finish_reason == "length" and out.auto_reuse["tokens"] > 0
    assert st.auto_reuse_audits_failed == before.auto_reuse_audits_failed + 1
    assert st.auto_reuse_audits == before.auto_reuse_audits
    assert "auditing an answer from reused KV failed" in caplog.text
    assert st.kv_cache_usage == 0


def test_the_rate_draws_a_share_of_the_answers():
    audit = ShadowAudit(seed=3)
    assert not any(audit.sampled(0.0) for _ in range(100)) and all(audit.sampled(1.0) for _ in range(100))
    assert 400 < sum(audit.sampled(0.5) for _ in range(1000)) < 600


def kl_rows(reused, full) -> float:
    return float(torch.nn.functional.kl_div(reused.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                            reduction="sum"))


def test_an_audit_over_the_answer_measures_its_mean_kl_to_ordinary_prefills(llm, plain):
    """``auto_reuse_audit_tokens`` 4: the drift counted is the mean over the answer's first four tokens of the
    KL between the distribution each was drawn from and the one another engine's ordinary prefill of the
    prompt and the answer's tokens before it gives there (teacher-forced with the answer's own tokens)."""
    with audit_tokens(llm, 4) as e:
        reused(llm)  # the store holds the documents in order; this request's audit is counted before
        before = e.get_stats()
        assert e.reset_prefix_cache()
        rows, out = drawn_logits(llm, text(DOCS[::-1]))
        assert out.auto_reuse["tokens"] > 0 and len(out.token_ids) == 6
        st = e.get_stats()
    prompt = plain.engine.tokenizer.encode(text(DOCS[::-1]))
    assert prompt == out.prompt_token_ids
    want = []
    for j in range(4):
        assert plain.engine.reset_prefix_cache()
        full, _ = first_logits(plain, prompt + out.token_ids[:j])
        want.append(kl_rows(rows[j], full))
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1
    assert st.auto_reuse_audited_tokens == before.auto_reuse_audited_tokens + 4
    measured = st.auto_reuse_audit_kl["sum"] - before.auto_reuse_audit_kl["sum"]
    assert min(want) > 1e-5 and max(want) > 2 * min(want)  # drifts that differ: their mean is what counts
    assert measured == pytest.approx(sum(want) / 4, rel=1e-3, abs=1e-6)
    assert st.kv_cache_usage == 0 and not e.segment_reuse.has_pending


@contextlib.contextmanager
def audit_tokens(llm, k):
    """The engine with ``auto_reuse_audit_tokens`` k, back to 1 after."""
    llm.engine.config.auto_reuse_audit_tokens = k
    try:
        yield llm.engine
    finally:
        llm.engine.config.auto_reuse_audit_tokens = 1


def test_a_shorter_answer_is_audited_over_the_tokens_it_has(llm):
    with audit_tokens(llm, 16) as e:  # more than GREEDY's 6
        before = e.get_stats()
        _, out = reused(llm)
        st = e.get_stats()
    assert len(out.token_ids) == 6
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1  # the documents in order reused nothing
    assert st.auto_reuse_audited_tokens == before.auto_reuse_audited_tokens + 6
    assert st.kv_cache_usage == 0 and not e.segment_reuse.has_pending


def interrupted(llm, docs, max_tokens: int, after: int, interrupt):
    """The documents in ``docs``' order, audited over 16 tokens, interrupted (``interrupt(engine, seq)``) once
    ``after`` tokens are out, then run to the end: (the sequence, the stats before it, after it)."""
    with audit_tokens(llm, 16) as e:
        reused(llm)
        assert e.reset_prefix_cache()
        before = e.get_stats()
        seq = e.add_request(text(docs), SamplingParams(max_tokens=max_tokens, temperature=0))
        while len(seq.output_token_ids) < after:
            e.step()
        assert seq.num_auto_tokens > 0 and e.segment_reuse.has_pending
        interrupt(e, seq)
        while e.has_unfinished_requests():
            e.step()
        e.finish_pending()
        return seq, before, e.get_stats()


def test_an_aborted_answer_is_audited_on_its_rows_and_gives_its_blocks_back(llm):
    seq, before, st = interrupted(llm, DOCS[1:] + DOCS[:1], 40, 3, lambda e, seq: e.abort_request(seq.request_id))
    assert seq.finish_reason == "abort"
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1
    assert st.auto_reuse_audited_tokens == before.auto_reuse_audited_tokens + 3
    assert st.kv_cache_usage == 0 and not llm.engine.segment_reuse.has_pending


def test_a_preempted_answer_is_audited_on_the_rows_it_drew_from_reused_kv(llm):
    """Preempted (as under memory pressure), a request's KV is recomputed by an ordinary prefill: its later
    tokens are not drawn from reused KV, so its audit covers the rows before; it finishes as usual."""
    seq, before, st = interrupted(llm, DOCS[2:] + DOCS[:2], 8, 2, lambda e, seq: e.scheduler._preempt(seq))
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 8 and seq.num_preemptions == 1
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1
    assert st.auto_reuse_audited_tokens == before.auto_reuse_audited_tokens + 2
    assert st.kv_cache_usage == 0 and not llm.engine.segment_reuse.has_pending


def audit_beside_a_stream(llm, monkeypatch, allowance):
    """The documents reordered, audited while another request decodes, under a prefill allowance beside
    decodes (engine/pace.py; None: no stall target): the audit's KL and its pieces, as
    (positions computed, forward passes the engine had run before it)."""
    e, sr = llm.engine, llm.engine.segment_reuse
    sr.store.clear()
    assert e.reset_prefix_cache()
    llm.generate(text(DOCS), GREEDY)
    assert e.reset_prefix_cache()
    steps, pieces = [0], []
    stepped, piece = sr.stepped, shadow.prefill_piece

    def count_step():
        steps[0] += 1
        stepped()

    def record_piece(model, job, budget):
        before = job.done
        out = piece(model, job, budget)
        pieces.append((job.done - before, steps[0]))
        return out

    monkeypatch.setattr(sr, "stepped", count_step)
    monkeypatch.setattr(shadow, "prefill_piece", record_piece)
    monkeypatch.setattr(e.scheduler.pace, "allowance", lambda: allowance)
    stream = e.add_request("Count slowly from one to fifty:", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while not stream.output_token_ids:
        e.step()
    before = e.get_stats()
    seq = e.add_request(text(DOCS[::-1]), SamplingParams(max_tokens=2, temperature=0))
    while e.has_unfinished_requests():
        e.step()
    e.finish_pending()
    after = e.get_stats()
    assert seq.num_auto_tokens > 0 and after.auto_reuse_audits == before.auto_reuse_audits + 1
    monkeypatch.undo()
    return after.auto_reuse_audit_kl["sum"] - before.auto_reuse_audit_kl.get("sum", 0.0), pieces


def test_an_audit_beside_decoding_streams_runs_in_pieces_between_steps(llm, monkeypatch):
    """A stream decoding beside an audit waits at most one piece of the allowance for it per step (the
    audit's full prefill is chunked like any prompt's), and the audit measures what it measures whole."""
    whole_kl, whole = audit_beside_a_stream(llm, monkeypatch, None)
    assert len(whole) == 1
    kl, pieces = audit_beside_a_stream(llm, monkeypatch, 32)
    assert len(pieces) >= 4 and sum(n for n, _ in pieces) == sum(n for n, _ in whole)
    assert all(n <= 32 for n, _ in pieces[:-1]) and pieces[-1][0] <= 32 + 1
    assert all(a[1] < b[1] for a, b in zip(pieces, pieces[1:]))  # a forward pass between any two pieces
    assert kl == pytest.approx(whole_kl, rel=1e-3, abs=1e-7) and kl > 1e-5


def test_answers_drawn_while_the_most_audits_are_open_are_skipped_and_counted(llm, monkeypatch):
    monkeypatch.setattr(shadow, "MAX_IN_FLIGHT", 1)
    with audit_tokens(llm, 4) as e:
        reused(llm)
        assert e.reset_prefix_cache()
        before = e.get_stats()
        outs = llm.generate([text(DOCS[1:] + DOCS[:1]), text(DOCS[2:] + DOCS[:2])], GREEDY)
        st = e.get_stats()
    assert all(o.auto_reuse["tokens"] > 0 for o in outs)
    assert st.auto_reuse_audits == before.auto_reuse_audits + 1
    assert st.auto_reuse_audits_skipped == before.auto_reuse_audits_skipped + 1
    assert st.kv_cache_usage == 0 and not e.segment_reuse.has_pending


def test_the_options_are_checked():
    for bad in ({"auto_reuse_audit_rate": 1.5}, {"auto_reuse_audit_rate": float("nan")},
                {"auto_reuse_audit_tokens": 0}, {"auto_reuse_audit_tokens": 65},
                {"auto_reuse_audit_bound": -0.1}, {"auto_reuse_audit_trip": 1.0}):
        with pytest.raises(ValueError, match="auto_reuse_audit"):
            LLM(dtype="float32", num_kv_blocks=16, segment_reuse="auto", **bad)


def test_kl_and_the_histogram():
    a = torch.tensor([2.0, 0.5, -1.0])
    assert kl_to_full(a, a) == 0.0
    b = torch.tensor([0.5, 2.0, -1.0])
    p, q = a.softmax(-1).double(), b.softmax(-1).double()
    assert kl_to_full(a, b) == pytest.approx(float((p * (p / q).log()).sum()))
    st = AuditStats()
    for kl in (0.0005, 0.025, 0.04, 5.0):
        st.add(kl, bound=0.03)
    assert st.audits == 4 and st.over_bound == 2 and st.kl_sum == pytest.approx(5.0655)
    assert st.kl_counts[0] == 1 and st.kl_counts[st.buckets.index(0.03)] == 1 and st.kl_counts[-1] == 1
    assert st.tenants == {"-": [4, 2]}  # requests without a tenant label


def test_audits_are_counted_per_tenant_up_to_a_cap(monkeypatch):
    monkeypatch.setattr(shadow, "MAX_TENANTS", 2)
    st = AuditStats()
    for tenant, kl in (("a", 0.05), ("b", 0.0), ("a", 0.0), ("c", 0.5), ("d", 0.0)):
        st.add(kl, bound=0.03, tenant=tenant)
    assert st.tenants == {"a": [2, 1], "b": [1, 0], "other": [2, 1]}


def test_a_namespace_whose_audits_drift_gets_ordinary_prefills_until_its_hold_ends(llm, plain, monkeypatch):
    """The breaker (``auto_reuse_audit_trip``): two audited answers over the bound (``TRIP_MIN`` lowered to 2)
    turn automatic reuse off for that tenant alone; its next prompt is an exact prefill; after the hold it
    reuses again."""
    monkeypatch.setattr(breaker, "TRIP_MIN", 2)
    e, sr = llm.engine, llm.engine.segment_reuse
    now = [0.0]
    monkeypatch.setattr(sr, "breaker", breaker.DriftBreaker(clock=lambda: now[0]))
    e.config.auto_reuse_audit_rate, e.config.auto_reuse_audit_bound, e.config.auto_reuse_audit_trip = 1.0, 0.0, 0.5
    try:
        sr.store.clear()
        for salt in ("a", "b"):
            llm.generate({"prompt": text(DOCS), "cache_salt": salt}, GREEDY)
        reorders = (DOCS[::-1], DOCS[1:] + DOCS[:1], DOCS[2:] + DOCS[:2])

        def ask(salt, docs):
            assert e.reset_prefix_cache()
            return llm.generate({"prompt": text(docs), "cache_salt": salt}, GREEDY)[0]

        assert all(ask("a", d).auto_reuse["tokens"] > 0 for d in reorders[:2])  # audited, both over: tripped
        st = e.get_stats()
        assert st.auto_reuse_audit_trips == 1 and st.auto_reuse_namespaces_off == 1
        off = ask("a", reorders[2])
        assert off.auto_reuse["tokens"] == 0
        assert plain.engine.reset_prefix_cache()
        ref = plain.generate({"prompt": text(reorders[2]), "cache_salt": "a"}, GREEDY)[0]
        assert off.token_ids == ref.token_ids and off.logprobs == ref.logprobs  # exact
        assert ask("b", reorders[2]).auto_reuse["tokens"] > 0  # another tenant is judged on its own audits
        now[0] += breaker.TRIP_HOLD_S
        assert e.get_stats().auto_reuse_namespaces_off == 0
        assert ask("a", reorders[2]).auto_reuse["tokens"] > 0
    finally:
        e.config.auto_reuse_audit_trip = None


def test_the_breaker_judges_a_window_of_recent_audits():
    b = breaker.DriftBreaker(clock=lambda: 0.0)
    assert not any(b.record("n", True, None) for _ in range(50))  # no trip share: never
    for _ in range(breaker.TRIP_MIN - 1):
        assert not b.record("n", True, 0.5)
    assert b.record("n", True, 0.5) and b.off("n") and not b.off("m") and b.trips == 1
    fresh = breaker.DriftBreaker(clock=lambda: 0.0)
    verdicts = [fresh.record("n", i % 3 == 0, 0.4) for i in range(breaker.TRIP_WINDOW * 3)]
    assert not any(verdicts)  # a third over: never above 0.4 of a full window, nor of 10 or more
    assert [fresh.record("n", True, 0.4) for _ in range(4)] == [False, False, False, True]  # then 9 of 20 over
