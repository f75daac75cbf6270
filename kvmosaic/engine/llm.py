"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine, PromptInput, RequestOutput
from .sampling_params import SamplingParams
from .stats import EngineStats

log = logging.getLogger("kvmosaic")


class LLM:
    """``LLM()`` loads the shipped model; every :class:`EngineConfig` field is a keyword."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        config = EngineConfig(model=model, **kwargs)
        if kwargs.get("dtype", "auto") == "auto":
            log.info("dtype auto: %s on %s", config.dtype, config.torch_device)
        if config.quantization:
            log.info("weights: %s weight-only (model/quant.py)", config.quantization)
        self.engine = LLMEngine(config)

    @property
    def dtype(self) -> str:
        """The KV and compute dtype in use (what ``dtype="auto"`` chose)."""
        return self.engine.config.dtype

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: int | Seq[int] = 0,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order, with a
        prompt's ``n > 1`` samples one after another (``RequestOutput.index`` 0..n-1).
        ``priority`` (one, or one per prompt): higher is more important (SGLang's convention;
        vLLM's ``LLM`` reads it the other way): scheduled first under ``scheduling_policy=
        "priority"`` (engine/priority.py), its cached KV kept longer under the "priority" eviction
        policy."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("pass one SamplingParams, or one per prompt")
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError("pass one priority, or one per prompt")
        ids = []
        for p, sp, pr in zip(prompts, params_list, priorities):
            seq = self.engine.add_request(p, sp, priority=pr)
            ids += [seq.request_id, *self.engine.child_request_ids(seq.request_id, seq.params.n)]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": self.apply_chat_template(c), "cache_salt": cache_salt} for c in convs]
        if cache_salt is None:
            prompts = [p["prompt"] for p in prompts]
        return self.generate(prompts, params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", disable=not use_tqdm)
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        self.engine.finish_pending()
        bar.close()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()
