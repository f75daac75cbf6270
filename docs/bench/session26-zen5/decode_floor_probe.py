"""The bfloat16 floor of an audit over the answer: an ordinary request (no reuse), its decode steps' logits
rows against a full prefill of the prompt and the answer teacher-forced (the audit's reference), per position.
Run: python docs/bench/session26-zen5/decode_floor_probe.py bfloat16|float32"""
import torch, pytest
from kvmosaic.engine.llm import LLM
from kvmosaic.engine import llm_engine
from kvmosaic.engine.sampler import sample_rows
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.blend.shadow import AuditJob, AuditRecord, kl_to_full, prefill_piece, scratch_with_prefix
import sys
dtype = sys.argv[1]
llm = LLM(dtype=dtype, num_kv_blocks=256)
e = llm.engine
prompts = ["The history of the lighthouse on Gull Point begins in 1871, when the harbour board " * 4 + "Question: when was it built?",
           "Write a short story about a ferry to Marsh Island that leaves at seven. " * 5]
for p in prompts:
    rows = []
    def keep(logits, *a, **k):
        rows.append(logits[-1].clone()); return sample_rows(logits, *a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "sample_rows", keep)
        out = llm.generate(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    ids = out.prompt_token_ids + out.token_ids[:15]
    record = AuditRecord(out.prompt_token_ids, torch.zeros(0, dtype=torch.long), 0, (None, None), None, [], 0,
                         rows=rows[:16])
    job = AuditJob(record, ids, scratch_with_prefix(e.kv, len(ids), record.slots, 0), 0)
    full = prefill_piece(e.model, job, None)
    per = [kl_to_full(full[i], rows[i]) for i in range(16)]
    print(dtype, "first", f"{per[0]:.2e}", "mean", f"{sum(per)/16:.2e}", "max", f"{max(per):.2e}")
