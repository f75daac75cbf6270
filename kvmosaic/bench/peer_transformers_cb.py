"""transformers' own paged continuous batching (``model.generate_batch``, transformers >= 5) with
block sharing on (``ContinuousBatchingConfig(allow_block_sharing=True)``: prefix caching across the
requests the manager holds), greedy, exactly ``max_tokens`` tokens (no EOS).

The manager is kept between calls (``persistent_manager=True``), so blocks of earlier requests can
be shared by later ones, as kvmosaic's prefix cache does; ``reset`` drops it. Cached tokens are
what the cache's ``search_prefix_match`` returned for the request (counted by wrapping it).
TTFT comes from the per-token timestamps ``record_timestamps=True`` gives.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .peer_api import Generation, PeerSettings, clock


class TransformersCBPeer:
    def __init__(self, settings: PeerSettings) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.generation.continuous_batching import cache as cb_cache

        from kvmosaic.model.loader import shipped_model_path

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if settings.threads:
            torch.set_num_threads(settings.threads)
        path = Path(settings.model_path or shipped_model_path())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=getattr(torch, settings.dtype))
        self.model.eval()
        self.matched: dict[str, int] = {}
        original = cb_cache.PagedAttentionCache.search_prefix_match
        matched = self.matched

        def counting(cache_self, request_id: str, prompt_ids: list[int]) -> int:
            n = original(cache_self, request_id, prompt_ids)
            matched[request_id] = matched.get(request_id, 0) + n
            return n

        cb_cache.PagedAttentionCache.search_prefix_match = counting

    def _configs(self, max_tokens: int):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        # Sized explicitly: left to itself on CPU it preallocates ~13 GB of KV (RSS 14.3 GB measured, SmolLM2-135M).
        # 128 blocks x 256-token pages = 32k tokens (~1.5 GB float32); 2048 tokens per step, as kvmosaic's default.
        return gen, ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=128, max_batch_tokens=2048)

    def generate_many(self, prompts: list[list[int]], max_tokens: int) -> list[Generation]:
        """All ``prompts`` submitted together in one ``generate_batch`` call."""
        import torch

        gen, cb = self._configs(max_tokens)
        self.matched.clear()
        start = clock()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = self.model.generate_batch([list(p) for p in prompts], generation_config=gen,
                                             continuous_batching_config=cb, record_timestamps=True,
                                             persistent_manager=True, warmup=False)
        end = clock()
        results = []
        for rid, out in outs.items():
            if out.error:
                raise RuntimeError(f"transformers generate_batch: {out.error}")
            stamps = out.timestamps or []
            # timestamps are perf_counter values (the clock the peers use)
            ttft = (stamps[0] - start) if stamps else end - start
            results.append(Generation(list(out.generated_tokens), ttft, end - start, self.matched.get(rid, 0)))
        return results

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        return self.generate_many([prompt_ids], max_tokens)[0]

    def reset(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
