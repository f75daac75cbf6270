"""Turns a scheduled step into one packed forward pass and returns last-token logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.paged import PagedKVCache
from ..model.attention import AttentionMetadata, DecodeBatch, PrefillSpan, prefill_mask
from ..model.llama import LlamaForCausalLM
from .scheduler import ScheduledSeq


@dataclass
class StepResult:
    logits: torch.Tensor  # [num_sampling, vocab] float32
    sampling: list[ScheduledSeq]  # the sequences that reached their last token, row order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = kv.device

    def prepare(self, batch: list[tuple[ScheduledSeq, list[int]]]):
        """Build the packed inputs; ``batch`` pairs each scheduled sequence with its table."""
        ids, pos, slot_map, logits_index, sampling = [], [], [], [], []
        prefills: list[PrefillSpan] = []
        dec_index, dec_slots = [], []
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
            else:
                prefills.append(PrefillSpan(t, t + n, slots, prefill_mask(n, end)))
            t += n
            if end == s.seq.num_tokens:
                logits_index.append(t - 1)
                sampling.append(s)
        decode = None
        if dec_index:
            lens = torch.tensor([len(x) for x in dec_slots])
            padded = torch.nn.utils.rnn.pad_sequence(dec_slots, batch_first=True)
            mask = None
            if int(lens.min()) != padded.shape[1]:
                mask = (torch.arange(padded.shape[1])[None, :] < lens[:, None])[:, None, None, :]
            decode = DecodeBatch(torch.tensor(dec_index), padded, mask)
        meta = AttentionMetadata(torch.cat(slot_map), prefills, decode)
        return torch.tensor(ids, dtype=torch.long), torch.cat(pos), meta, torch.tensor(logits_index, dtype=torch.long), sampling

    def execute(self, batch: list[tuple[ScheduledSeq, list[int]]]) -> StepResult:
        ids, pos, meta, logits_index, sampling = self.prepare(batch)
        dev = self.device
        if dev.type != "cpu":
            meta = _to_device(meta, dev)
            ids, pos, logits_index = ids.to(dev), pos.to(dev), logits_index.to(dev)
        logits = self.model(ids, pos, self.kv, meta, logits_index)
        return StepResult(logits, sampling)


def _to_device(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    mv = lambda x: None if x is None else x.to(dev, non_blocking=True)  # noqa: E731
    prefills = [PrefillSpan(p.start, p.end, mv(p.ctx_slots), mv(p.mask)) for p in meta.prefills]
    d = meta.decode
    decode = None if d is None else DecodeBatch(mv(d.token_index), mv(d.ctx_slots), mv(d.mask))
    return AttentionMetadata(mv(meta.slot_mapping), prefills, decode)
