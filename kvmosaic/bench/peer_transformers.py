"""transformers on the same GGUF weights and dtype.

Greedy decoding with the model's forward and a ``DynamicCache`` (what ``generate`` does, without
its per-call set-up, so TTFT is exact: prefill plus the first token's argmax). With
``reuse_prompts`` the KV of earlier prompts is reused (:mod:`.hf_prompt_cache`); without it,
nothing is reused across requests, which is what a plain user gets.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .hf_prompt_cache import PromptCacheStore
from .peer_api import Generation, PeerSettings, clock


class TransformersPeer:
    def __init__(self, settings: PeerSettings, reuse_prompts: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from kvmosaic.model.loader import shipped_model_path

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if settings.threads:
            torch.set_num_threads(settings.threads)
        path = Path(settings.model_path or shipped_model_path())
        dtype = getattr(torch, settings.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        self.model.eval()
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
        self.store = PromptCacheStore(per_token) if reuse_prompts else None

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        import torch
        from transformers import DynamicCache

        start = clock()
        cache, cached = self.store.lookup(prompt_ids) if self.store else (None, 0)
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        tokens: list[int] = []
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids[cached:]])
            pos = torch.arange(cached, len(prompt_ids))
            for step in range(max_tokens):
                out = self.model(input_ids=ids, past_key_values=cache, cache_position=pos,
                                 use_cache=True, logits_to_keep=1)
                tok = int(out.logits[0, -1].argmax())
                tokens.append(tok)
                if step == 0:
                    first = clock()
                ids, pos = torch.tensor([[tok]]), pos[-1:] + 1
        if self.store is not None:
            seq = list(prompt_ids) + tokens[:-1]
            self.store.insert(seq[: cache.get_seq_length()], cache)
        return Generation(tokens, first - start, clock() - start, cached)

    def reset(self) -> None:
        if self.store is not None:
            self.store.clear()
