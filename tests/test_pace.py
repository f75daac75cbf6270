"""A prompt beside decoding streams is cut into steps of ``max_decode_stall_ms`` (engine/pace.py).

* the pace's arithmetic: a step is ``base + per_token * prompt tokens``, each a moving average
  of measured steps; the allowance fills the stall target, never under ``MIN_CHUNK``, and is
  ``UNMEASURED_CHUNK`` until a step of ``MIN_SAMPLE`` prompt tokens was measured;
* the real scheduler and model: while a stream decodes, a long prompt is computed in chunks of
  the allowance; with nothing decoding, in one step; the tokens generated are those of the
  engine without a pace;
* the default: 500 ms when serving, off in ``LLM()``.

The server-level bound (a stream's longest wait beside a ~900-token prompt, one process and
``--replicas 2``) is in tests/test_fair_share.py.
"""

from __future__ import annotations

import pytest

from kvmosaic.engine.config import EngineConfig
from kvmosaic.engine.llm_engine import LLMEngine
from kvmosaic.engine.pace import MIN_CHUNK, MIN_SAMPLE, SERVING_STALL_MS, UNMEASURED_CHUNK, PrefillPace
from kvmosaic.engine.sampling_params import SamplingParams

LONG = [1000 + (i * 37) % 20000 for i in range(200)]
SHORT = list(range(3000, 3012))
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_allowance_fills_the_stall_target_from_measured_steps():
    pace = PrefillPace(stall_ms=500)
    assert pace.allowance() == UNMEASURED_CHUNK
    pace.observe(0, 0.020)  # a decode-only step
    pace.observe(MIN_SAMPLE - 1, 1.0)  # too few prompt tokens to tell their cost from the step's
    assert pace.allowance() == UNMEASURED_CHUNK
    pace.observe(100, 0.220)  # 100 prompt tokens beside the decodes: 2 ms a token beyond them
    assert pace.base == pytest.approx(0.020) and pace.per_token == pytest.approx(0.002)
    assert pace.allowance() == 240  # (0.5 - 0.02) / 0.002
    pace.observe(100, 0.420)  # the machine got slower: 4 ms a token, averaged with the 2 before
    assert pace.per_token == pytest.approx(0.003) and pace.allowance() == 160
    pace.observe(100, 60.0)  # far too slow for any chunk: a prompt still advances
    assert pace.allowance() == MIN_CHUNK
    assert PrefillPace(stall_ms=0).allowance() is None


def engine(stall_ms: float) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=256, max_decode_stall_ms=stall_ms,
                                  adaptive_threads=False))


def fixed_pace(e: LLMEngine, tokens: int) -> None:
    """The pace at a fixed rate of ``tokens`` prompt tokens per stall target (no measuring)."""
    pace = e.scheduler.pace
    pace.observe = lambda *a: None
    pace.base, pace.per_token = 0.0, pace.stall_s / tokens


def run(e: LLMEngine, stream_first: bool) -> tuple[dict[str, list[int]], list[int]]:
    """Outputs of SHORT (started first, decoding when LONG arrives, if ``stream_first``) and
    LONG; and LONG's prompt chunks, step by step."""
    chunks: list[int] = []
    schedule = e.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend(s.num_new_tokens for s in out.scheduled
                      if s.seq.request_id == "long" and s.seq.num_computed_tokens < s.seq.num_prompt_tokens)
        return out

    e.scheduler.schedule = recorded
    tokens: dict[str, list[int]] = {}
    if stream_first:
        e.add_request(SHORT, PARAMS, request_id="stream")
        while not any(o.token_ids for o in e.step()):
            pass
    e.add_request(LONG, PARAMS, request_id="long")
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                tokens[o.request_id] = o.token_ids
    return tokens, chunks


def test_a_prompt_beside_a_stream_is_cut_to_the_allowance_and_generates_the_same():
    paced = engine(500)
    fixed_pace(paced, 48)
    tokens, chunks = run(paced, stream_first=True)
    assert chunks == [48, 48, 48, 48, 8], chunks  # 200 prompt tokens, 48 a step while the stream decodes
    want, whole = run(engine(0), stream_first=True)
    assert whole == [200]
    assert tokens == want


def test_with_nothing_decoding_a_prompt_takes_the_whole_budget():
    paced = engine(500)
    fixed_pace(paced, 48)
    _, chunks = run(paced, stream_first=False)
    assert chunks == [200]


def test_serving_defaults_to_a_stall_bound_and_llm_to_none():
    assert EngineConfig(dtype="float32", device="cpu", usage_context="server").max_decode_stall_ms == SERVING_STALL_MS
    assert EngineConfig(dtype="float32", device="cpu").max_decode_stall_ms == 0
    assert EngineConfig(dtype="float32", device="cpu", usage_context="server",
                        max_decode_stall_ms=0).max_decode_stall_ms == 0
    with pytest.raises(ValueError, match="max_decode_stall_ms"):
        EngineConfig(dtype="float32", device="cpu", max_decode_stall_ms=-1)


def test_a_blended_prompt_is_not_taken_for_the_cost_of_a_prefill():
    """Segment reuse computes a prompt at a fraction of a prefill's cost: were that step observed,
    the pace would allow more prompt tokens than the stall target holds."""
    e = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=256, max_decode_stall_ms=500,
                               adaptive_threads=False, segment_reuse="auto", segment_cache_memory=64 << 20))
    seen: list[int] = []
    observe = e.scheduler.pace.observe
    e.scheduler.pace.observe = lambda tokens, seconds: (seen.append(tokens), observe(tokens, seconds))
    docs = [" ".join(f"fact {d}.{i} is the number {d * 97 + i * 13}." for i in range(12)) for d in range(3)]
    outs = []
    for order in (docs, docs[::-1]):
        e.add_request("Answer from the documents.\n\n" + "\n\n".join(order) + "\n\nQuestion: which fact?",
                      SamplingParams(max_tokens=1, temperature=0.0))
        while e.has_unfinished_requests():
            outs += [o for o in e.step() if o.finished]
    assert outs[0].auto_reuse["tokens"] == 0 and outs[1].auto_reuse["tokens"] > 100  # the second was blended
    assert [t for t in seen if t] == [len(outs[0].prompt_token_ids)]  # only the full prefill was observed
