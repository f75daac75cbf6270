"""kvmosaic itself, driven step by step so TTFT is timed like the other peers'."""

from __future__ import annotations

from .peer_api import Generation, PeerSettings, clock


class KvmosaicPeer:
    def __init__(self, prefix_cache: str, settings: PeerSettings, quantization: str | None = None) -> None:
        from kvmosaic import LLM

        self.llm = LLM(model=settings.model_path, prefix_cache=prefix_cache, dtype=settings.dtype,
                       num_threads=settings.threads, quantization=quantization)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        from kvmosaic import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = clock()
        seq = engine.add_request(list(prompt_ids), params)
        first, final = None, None
        while final is None and engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.token_ids:
                    first = clock()
                if out.finished and out.request_id == seq.request_id:
                    final = out
        end = clock()
        engine.finish_pending()  # what the last step deferred, outside the next request's time
        return Generation(list(final.token_ids), first - start, end - start, final.num_cached_tokens)

    def generate_many(self, prompts: list[list[int]], max_tokens: int) -> list[Generation]:
        """All ``prompts`` submitted together (what ``LLM.generate`` does), stepping the engine;
        each step's scheduled tokens and wall time go to ``self.steps`` (the last call's)."""
        from kvmosaic import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.steps: list[dict] = []
        schedule = engine.scheduler.schedule

        def recording():
            sched = schedule()
            self.steps.append({"seqs": len(sched.scheduled), "tokens": sched.num_tokens,
                               "prefill_seqs": sum(1 for s in sched.scheduled if s.num_new_tokens > 1)})
            return sched

        engine.scheduler.schedule = recording
        try:
            start = clock()
            ids = [engine.add_request(list(p), params).request_id for p in prompts]
            first: dict[str, float] = {}
            done = {}
            last = start
            while len(done) < len(ids) and engine.has_unfinished_requests():
                outs = engine.step()
                now = clock()
                if self.steps:
                    self.steps[-1]["s"] = now - last
                last = now
                for out in outs:
                    if out.token_ids and out.request_id not in first:
                        first[out.request_id] = now
                    if out.finished:
                        done[out.request_id] = (out, now)
        finally:
            engine.scheduler.schedule = schedule
        engine.finish_pending()
        return [Generation(list(done[i][0].token_ids), first[i] - start, done[i][1] - start, done[i][0].num_cached_tokens)
                for i in ids]

    def reset(self) -> None:
        self.llm.reset_prefix_cache()
