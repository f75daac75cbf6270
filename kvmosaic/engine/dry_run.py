"""The real scheduler and cache manager driven without a model: what scheduling studies and the
model-free tests run (``tests/sched_sim.py``, ``benchmarks/lens_cost.py``). A step schedules,
commits the pending block copies, advances every scheduled sequence by its tokens, gives each
one whose prompt is now computed a dummy output token, and finishes it at ``max_tokens``."""

from __future__ import annotations

from .scheduler import Scheduler, SchedulerOutput

DUMMY_TOKEN = 7


def dry_step(sched: Scheduler, max_tokens: int) -> SchedulerOutput:
    out = sched.schedule()
    sched.kv.take_pending_copies()
    sched.update(out)
    for s in out.scheduled:
        seq = s.seq
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(DUMMY_TOKEN)
            if len(seq.output_token_ids) >= max_tokens:
                sched.finish(seq, "length")
    return out
