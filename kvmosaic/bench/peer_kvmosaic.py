"""kvmosaic itself, driven step by step so TTFT is timed like the other peers'."""

from __future__ import annotations

from .peer_api import Generation, PeerSettings, clock


class KvmosaicPeer:
    def __init__(self, prefix_cache: str, settings: PeerSettings) -> None:
        from kvmosaic import LLM

        self.llm = LLM(model=settings.model_path, prefix_cache=prefix_cache, dtype=settings.dtype,
                       num_threads=settings.threads)

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
        return Generation(list(final.token_ids), first - start, end - start, final.num_cached_tokens)

    def reset(self) -> None:
        self.llm.reset_prefix_cache()
