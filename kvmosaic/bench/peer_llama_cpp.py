"""llama-cpp-python on the same GGUF file (its own Q4_1 kernels), with ``LlamaRAMCache``.

``create_completion`` restores the saved state sharing the longest prefix with the prompt (or
keeps its live context when that shares more) and prefills only the rest. TTFT is the moment the
first token is sampled (``Llama.sample`` is wrapped to record sampled tokens and their times).
"""

from __future__ import annotations

import os

from .peer_api import Generation, PeerSettings, clock


class LlamaCppPeer:
    def __init__(self, settings: PeerSettings, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        from kvmosaic.model.loader import shipped_model_path

        threads = settings.threads or os.cpu_count()
        self.llm = Llama(model_path=settings.model_path or shipped_model_path(), n_ctx=n_ctx,
                         n_threads=threads, n_threads_batch=threads, verbose=False)
        self.reset()
        self.sampled: list[tuple[int, float]] = []
        sample = self.llm.sample

        def recording_sample(*args, **kwargs):
            token = sample(*args, **kwargs)
            self.sampled.append((int(token), clock()))
            return token

        self.llm.sample = recording_sample

    def expected_reuse(self, prompt_ids: list[int]) -> int:
        """Tokens llama-cpp-python will not prefill again: the longer of its live context's and
        its RAM cache's common prefix with the prompt (all but the last token at most)."""
        from llama_cpp import Llama

        live = Llama.longest_token_prefix(self.llm._input_ids[: self.llm.n_tokens].tolist(), prompt_ids)
        key = self.llm.cache._find_longest_prefix_key(tuple(prompt_ids)) if self.llm.cache else None
        saved = Llama.longest_token_prefix(key, prompt_ids) if key else 0
        return min(max(live, saved), len(prompt_ids) - 1)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        reused = self.expected_reuse(prompt_ids)
        self.sampled = []
        start = clock()
        self.llm.create_completion(prompt=list(prompt_ids), max_tokens=max_tokens, temperature=0.0,
                                   logit_bias={self.llm.token_eos(): -1e9})
        end = clock()
        tokens = [t for t, _ in self.sampled[:max_tokens]]
        return Generation(tokens, self.sampled[0][1] - start, end - start, reused)

    def reset(self) -> None:
        from llama_cpp import LlamaRAMCache

        self.llm.reset()
        self.llm.set_cache(LlamaRAMCache(capacity_bytes=1 << 30))
