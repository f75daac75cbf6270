"""Turns a scheduled step into one packed forward pass and returns last-token logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..kv.paged import PagedKVCache
from ..model import kernels
from ..model.attention import AttentionMetadata, DecodeBatch, PrefillSpan, SharedPrefix
from ..model.llama import LlamaForCausalLM
from ..model.packed_linear import rows_on_their_own
from ..model.window import GroupedMetadata
from .prompt_logprobs import Scored, prompt_rows, score
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq
from .scored_prefix import ScoredPrefixCache, score_prefixes
from .sequence import Sequence

# Cascade decode attention (model/attention.py) for a prefix shared by at least two decodes and
# at least this many blocks long; shorter ones cost more in extra kernel calls than they save.
CASCADE_MIN_BLOCKS = 4


def cascade_pays(model: LlamaForCausalLM, kv: PagedKVCache) -> bool:
    """Whether cascade attention is faster here than each decode reading its whole context.

    Not where the in-place decode kernel serves the pool (``model/kernels``): reading a shared
    prefix once per row there costs less than gathering it once and merging partial results in
    torch (measured with ``python -m benchmarks.cascade --dtype bfloat16``: cascade 0.80 / 0.85 /
    0.87x of the plain path's speed at 4 / 16 / 32 decodes behind a 680-token prefix). In bfloat16 on
    AMX the kernel attends a shared prefix's chunks once for all their rows itself (``paged_decode_share``,
    docs/ARCHITECTURE.md "A request's life"), with each row's bits as when it is alone."""
    cfg = model.config
    q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=kv.dtype, device=kv.device)
    return not kernels.available(q, kv.k[0])


@dataclass
class StepResult:
    logits: torch.Tensor  # [num_sampling, vocab] float32
    sampling: list[ScheduledSeq]  # the sequences that reached their last token, row order
    # (sequence, first position, entries) of the step's prompt log-probabilities (prompt_logprobs.py)
    prompt_logprobs: Scored = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, cascade: bool = True,
                 batch_invariant: bool = False) -> None:
        """``batch_invariant``: a step of decodes and prompt tokens runs as two passes, the decodes
        alone first (see :meth:`execute`)."""
        self.model = model
        self.kv = kv
        self.cascade = cascade and cascade_pays(model, kv)
        self.batch_invariant = batch_invariant
        self.device = kv.device
        # Scored prompts' hidden rows by block (engine/scored_prefix.py; None: off), set by the engine
        self.scored: ScoredPrefixCache | None = None

    def warm_up(self, prompt_tokens: int = 16) -> None:
        """Run one short prompt and one decode step over the pool's first blocks, before any
        request holds a block (the engine calls it at start-up, when the pool is empty): the
        first request then does not pay for what a process's first forward pass builds once
        (oneDNN's primitives, the kernels' first calls, the fused decode step's decision), as vLLM
        runs a dummy batch before it serves. The output is dropped; what the pass wrote into those
        blocks is overwritten by the first request that gets them, as any freed block's is."""
        bs, groups = self.kv.block_size, len(self.kv.layout.groups)
        per_group = -(-(prompt_tokens + 1) // bs)
        if per_group * groups > self.kv.num_blocks:
            return
        tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(groups)]
        table = tables if self.kv.layout.hybrid else tables[0]
        seq = Sequence("warm-up", None, [0] * prompt_tokens, SamplingParams(max_tokens=1))
        self.execute([(ScheduledSeq(seq, prompt_tokens), table)])
        seq.num_computed_tokens = prompt_tokens
        seq.append_token(0)
        self.execute([(ScheduledSeq(seq, 1), table)])

    def prepare(self, batch: list[tuple[ScheduledSeq, list]]):
        """Build the packed inputs; ``batch`` pairs each scheduled sequence with its table, or
        under a hybrid KV layout with its tables, one per layer group (then the metadata is a
        :class:`GroupedMetadata`; window groups never cascade: their layers' views dissolve it)."""
        layout = self.kv.layout
        if not layout.hybrid:
            return self._prepare(batch, self.cascade)
        metas = []
        for g, group in enumerate(layout.groups):
            ids, pos, meta, logits_index, sampling = self._prepare(
                [(s, tables[g]) for s, tables in batch], self.cascade and group.window is None)
            metas.append(meta)
        return ids, pos, GroupedMetadata(metas, layout.group_of), logits_index, sampling

    def _prepare(self, batch: list[tuple[ScheduledSeq, list[int]]], cascade: bool):
        if batch and not cascade and all(_is_decode(s) for s, _ in batch):
            return self._prepare_decodes(batch)
        return self._prepare_rows(batch, cascade)

    def _prepare_rows(self, batch: list[tuple[ScheduledSeq, list[int]]], cascade: bool):
        """Any step: prefill spans and decodes, sequence by sequence."""
        ids, pos, slot_map, logits_index, sampling = [], [], [], [], []
        prefills: list[PrefillSpan] = []
        dec_index, dec_slots, dec_tables = [], [], []
        t = 0
        for s, table in batch:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            end = start + n
            ids.extend(s.seq.all_token_ids[start:end])
            pos.append(torch.arange(start, end))
            slots = self.kv.slots(table, end)
            slot_map.append(slots[start:])
            if n == 1:
                dec_index.append(t)
                dec_slots.append(slots)
                dec_tables.append(table)
            else:
                prefills.append(PrefillSpan(t, t + n, slots, None))  # causal, the context's last n
            t += n
            if end == s.seq.num_tokens:
                logits_index.append(t - 1)
                sampling.append(s)
        decode = None
        if dec_index:
            decode = self._decode_batch(dec_index, dec_slots, dec_tables, cascade)
        meta = AttentionMetadata(torch.cat(slot_map), prefills, decode)
        return torch.tensor(ids, dtype=torch.long), torch.cat(pos), meta, torch.tensor(logits_index, dtype=torch.long), sampling

    def _prepare_decodes(self, batch: list[tuple[ScheduledSeq, list[int]]]):
        """:meth:`_prepare_rows` for a step of decodes only, every row its sequence's last token (so
        every row is sampled), without cascade groups: the same tensors, built for the whole batch
        at once in numpy (a few array operations instead of a dozen torch calls: this runs once a
        token, right after the weights' stream has evicted the interpreter's caches)."""
        bs, rows = self.kv.block_size, len(batch)
        lens = np.fromiter((s.seq.num_tokens for s, _ in batch), np.int64, rows)
        longest = int(lens.max())
        width = -(-longest // bs)
        tables = np.zeros((rows, width), np.int64)  # block 0 past a short table
        for i, (_, table) in enumerate(batch):
            row = table[:width]
            tables[i, : len(row)] = row
        ctx = (tables[:, :, None] * bs + np.arange(bs)).reshape(rows, -1)[:, :longest]
        mask = None
        if int(lens.min()) != longest:
            pad = np.arange(longest)[None, :] >= lens[:, None]
            ctx[pad] = 0  # padded with slot 0, as DecodeBatch says
            mask = torch.from_numpy(~pad)[:, None, None, :]
        ctx = np.ascontiguousarray(ctx)
        index = np.arange(rows)
        last = ctx[index, lens - 1]
        ids = np.fromiter((s.seq.all_token_ids[-1] for s, _ in batch), np.int64, rows)
        index_t = torch.from_numpy(index)
        meta = AttentionMetadata(torch.from_numpy(last), [],
                                 DecodeBatch(index_t, torch.from_numpy(ctx), mask, [], torch.from_numpy(lens)))
        return torch.from_numpy(ids), torch.from_numpy(lens - 1), meta, index_t, [s for s, _ in batch]

    def _decode_batch(self, index: list[int], slots: list[torch.Tensor], tables: list[list[int]],
                      cascade: bool = True) -> DecodeBatch:
        bs = self.kv.block_size
        shared = []
        groups = shared_prefixes(tables, [len(x) for x in slots], bs, CASCADE_MIN_BLOCKS) if cascade else []
        for num_blocks, members in groups:
            shared.append(SharedPrefix(slots[members[0]][: num_blocks * bs], torch.tensor(members)))
            for i in members:
                slots[i] = slots[i][num_blocks * bs :]
        lens = torch.tensor([len(x) for x in slots])
        padded = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
        mask = None
        if int(lens.min()) != padded.shape[1]:
            mask = (torch.arange(padded.shape[1])[None, :] < lens[:, None])[:, None, None, :]
        return DecodeBatch(torch.tensor(index), padded, mask, shared, lens)

    def execute(self, batch: list[tuple[ScheduledSeq, list[int]]]) -> StepResult:
        """One forward pass over the step; with ``batch_invariant``, a step that mixes decodes and
        prompt tokens as two: the decodes take the path a step of decodes alone takes (the fused
        decode step where it serves), whose rows do not depend on the batch, instead of the
        layers' GEMMs shared with the prompt rows, which sum in another order; and the prompt rows
        take the tile GEMM at any count where the step is on the tile unit (``rows_on_their_own``:
        oneDNN's bfloat16 GEMM on AMX changes a row with the row count). The logits' rows follow
        ``sampling`` either way."""
        if not self.batch_invariant:
            return self._forward(batch)
        decodes, prompts = [], []
        for pair in batch:
            (decodes if _is_decode(pair[0]) else prompts).append(pair)
        with rows_on_their_own():  # prompt rows on the tile GEMM where oneDNN's changes a row with the count
            if not (decodes and prompts):
                return self._forward(batch)
            first, second = self._forward(decodes), self._forward(prompts)
        return StepResult(torch.cat((first.logits, second.logits)), first.sampling + second.sampling,
                          first.prompt_logprobs + second.prompt_logprobs)

    def _forward(self, batch: list[tuple[ScheduledSeq, list[int]]]) -> StepResult:
        ids, pos, meta, logits_index, sampling = self.prepare(batch)
        dev = self.device
        if dev.type != "cpu":
            meta = _to_device(meta, dev)
            ids, pos, logits_index = ids.to(dev), pos.to(dev), logits_index.to(dev)
        rows = prompt_rows(batch)
        prefixes = score_prefixes(self.model, batch) if self.scored is not None else []
        if rows is None:
            return StepResult(self.model(ids, pos, self.kv, meta, logits_index), sampling, prefixes)
        logits, hidden = self.model(ids, pos, self.kv, meta, logits_index, rows.index.to(dev))
        if self.scored is not None:
            self.scored.keep_step(rows, hidden)
        return StepResult(logits, sampling, prefixes + score(self.model, hidden, rows))


def _is_decode(s: ScheduledSeq) -> bool:
    """One new token, the sequence's last: a decode (or a prompt's last token, computed as one)."""
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens + 1 == s.seq.num_tokens


def shared_prefixes(tables: list[list[int]], ctx_lens: list[int], block_size: int,
                    min_blocks: int) -> list[tuple[int, list[int]]]:
    """Groups of decode rows whose block tables begin with the same blocks: ``(number of
    shared blocks, rows)`` for each group of two or more sharing at least ``min_blocks``.

    Rows are grouped by their first block; a group shares the longest run of leading blocks
    common to all its rows, cut so that those blocks lie wholly inside every row's context and
    every row keeps at least one token of its own. Attending the shared slots once is then the
    same attention as each row attending them: they are the same memory.
    """
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if table:
            by_first.setdefault(table[0], []).append(i)
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        common = min((ctx_lens[i] - 1) // block_size for i in rows)
        first = tables[rows[0]]
        for i in rows[1:]:
            table = tables[i]
            n = 0
            while n < common and table[n] == first[n]:
                n += 1
            common = n
        if common >= min_blocks:
            groups.append((common, rows))
    return groups


def _to_device(meta: AttentionMetadata | GroupedMetadata, dev: torch.device) -> AttentionMetadata | GroupedMetadata:
    if isinstance(meta, GroupedMetadata):
        return GroupedMetadata([_to_device(m, dev) for m in meta.groups], meta.group_of)
    mv = lambda x: None if x is None else x.to(dev, non_blocking=True)  # noqa: E731
    prefills = [PrefillSpan(p.start, p.end, mv(p.ctx_slots), mv(p.mask), mv(p.positions)) for p in meta.prefills]
    d = meta.decode
    decode = None if d is None else DecodeBatch(
        mv(d.token_index), mv(d.ctx_slots), mv(d.mask), [SharedPrefix(mv(p.slots), mv(p.members)) for p in d.shared],
        mv(d.lens))
    return AttentionMetadata(mv(meta.slot_mapping), prefills, decode)
