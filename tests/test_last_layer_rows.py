"""The last layer runs only the rows whose output is read (``QueryRows``): every row's K and V
are still written, and a read row's logits are what the whole layer gives it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvmosaic import SamplingParams
from kvmosaic.model.attention import AttentionMetadata, DecodeBatch, PrefillSpan, paged_attention
from kvmosaic.model.llama import QueryRows
from tests.conftest import make_llm, packed_gemm_rows_invariant, record_logits


def _mixed_step(dtype: torch.dtype):
    """A step of a 30-token prompt, a 12-token chunk behind a 20-token past and two decodes."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, pool = 6, 2, 64, 400
    k, v = (torch.randn(pool, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(pool, generator=g)
    a, b = slots[:30], slots[30:62]
    decodes = [slots[100:141], slots[150:157]]
    lens = torch.tensor([41, 7])
    padded = torch.nn.utils.rnn.pad_sequence(decodes, batch_first=True)
    mask = (torch.arange(padded.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    decode = DecodeBatch(torch.tensor([42, 43]), padded, mask, [], lens)
    meta = AttentionMetadata(torch.cat((a, b[20:], slots[140:141], slots[156:157])),
                             [PrefillSpan(0, 30, a, None), PrefillSpan(30, 42, b, None)], decode)
    q = torch.randn(44, heads, dim, generator=g).to(dtype)
    return q, k, v, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[29, 41, 42, 43], [3, 17, 29, 35, 41, 42, 43], [0, 30, 31, 42, 43]])
def test_a_steps_rows_attend_alone_as_in_the_whole_step(rows, dtype):
    """Tail rows stay causal spans; others carry their positions: each selected row's attention
    output is the same bits as in the whole step."""
    q, k, v, meta = _mixed_step(dtype)
    index = torch.tensor(rows)
    cut = meta.select_queries(index)
    whole = paged_attention(q, k, v, meta, 0.125)
    alone = paged_attention(q.index_select(0, index), k, v, cut, 0.125)
    assert torch.equal(alone, whole.index_select(0, index))
    assert torch.equal(cut.slot_mapping, meta.slot_mapping[index])
    assert cut.decode.token_index.tolist() == [len(rows) - 2, len(rows) - 1]
    if rows[0] == 29:  # each span's last row: both still plain causal spans
        assert [(s.start, s.end, s.mask, s.positions) for s in cut.prefills] == [(0, 1, None, None), (1, 2, None, None)]


def test_a_decode_row_left_out_keeps_the_whole_step():
    _, _, _, meta = _mixed_step(torch.float32)
    assert meta.select_queries(torch.tensor([29, 41, 43])) is None
    assert QueryRows.of(meta, torch.arange(44), 44) is None  # every row read: nothing to cut


@contextlib.contextmanager
def _last_layer_rows(llm):
    """How many rows each step's last layer ran its MLP on (the model is shared by the engines of
    a process: the hook goes when the block ends)."""
    seen: list[int] = []
    hook = llm.engine.runner.model.layers[-1].down_proj.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].shape[0]))
    try:
        yield seen
    finally:
        hook.remove()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_layer_runs_the_sampled_rows_and_logits_stay_the_same(dtype, monkeypatch):
    """Chunked prompts beside decodes: the last layer's MLP sees one row per sampled sequence, and
    each step's logits are those of the whole layer: the same bits in bfloat16 where the CPU's GEMMs
    give a row the same result at any row count; float32's GEMMs sum a row in another order at
    another row count (to 1e-4 of the logits)."""
    prompts = [{"prompt_token_ids": list(range(200 + 7 * i, 240 + 9 * i + 25 * i))} for i in range(4)]
    params = [SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True) for i in range(4)]

    def run(cut: bool):
        llm = make_llm(dtype=dtype, block_size=16, max_num_batched_tokens=48, enable_prefix_caching=False)
        if not cut:
            monkeypatch.setattr(QueryRows, "of", classmethod(lambda cls, meta, index, n: None))
        logits = record_logits(llm)
        with _last_layer_rows(llm) as rows:
            outs = llm.generate(prompts, params)
        monkeypatch.undo()
        return [o.token_ids for o in outs], logits, rows

    tokens, logits, rows = run(cut=True)
    whole_tokens, whole_logits, whole_rows = run(cut=False)
    assert max(rows) <= 4 and sum(whole_rows) > 2 * sum(rows)
    assert tokens == whole_tokens
    exact = dtype == "bfloat16" and packed_gemm_rows_invariant()
    tol = 0.0 if exact else 1e-4 if dtype == "float32" else 0.5
    for rid, steps in whole_logits.items():
        for a, b in zip(logits[rid], steps, strict=True):
            assert (a - b).abs().max() <= tol


def test_a_blend_runs_its_last_layer_on_the_logits_row(monkeypatch):
    """Automatic segment reuse recomputes some rows through the later layers; the last layer runs
    only the row the answer is read from, and the answer's log-probabilities are those of the whole
    layer."""
    from kvmosaic.blend import forward as blend_forward_module
    from tests.test_auto_reuse import DOCS, text

    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

    def run(cut: bool):
        llm = make_llm(segment_cache_memory=128 << 20, segment_reuse="auto")
        llm.engine.config.auto_reuse_max_drift = 0.1
        if not cut:
            monkeypatch.setattr(blend_forward_module.QueryRows, "of", classmethod(lambda cls, meta, index, n: None))
        llm.generate(text(DOCS), greedy)
        assert llm.engine.reset_prefix_cache()
        with _last_layer_rows(llm) as rows:
            out = llm.generate(text(DOCS[::-1]), greedy)[0]
        monkeypatch.undo()
        return out, rows

    out, rows = run(cut=True)
    whole, whole_rows = run(cut=False)
    assert out.auto_reuse["tokens"] > 0  # a blend answered it
    assert rows == [1] and whole_rows[0] > 1
    (got,), (want,) = out.logprobs, whole.logprobs  # float32: to its GEMMs' rounding at another row count
    assert list(got) == list(want) and all(abs(got[t] - want[t]) <= 1e-4 for t in want)
