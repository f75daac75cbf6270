"""Input processing: every prompt form in, one validated :class:`ProcessedPrompt` out.

A prompt is text, token ids, ``{"prompt": text-or-ids, "cache_salt": str}``, or a segmented
prompt (``{"prompt": head, "segments": [doc, ...], "suffix": tail}``, see blend/prompt.py,
or a text prompt cut by the configured ``segment_separator``). It is parsed, tokenised and
checked here exactly once. The processor holds no mutable state, so it may run on any
thread: the server runs it off the engine thread, so a large prompt never stalls a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..blend.prompt import SegmentedPrompt, SegmentSpan, parse_segment_prompt, split_on_separator

PromptInput = str | list[int] | dict


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the engine: ``segments`` are the spans of its segments (None for
    an ordinary prompt); the engine reuses them only when segment reuse is on.
    ``public_blocks``: leading blocks shared by every tenant (shared-public tenancy, set by
    ``server/tenancy.py``): they are hashed without ``cache_salt`` (cache/hashing.py)."""

    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    segments: tuple[SegmentSpan, ...] | None = None
    public_blocks: int = 0


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_prompt_blocks: int,
                 block_size: int, segment_separator: str | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_blocks = max_prompt_blocks
        self.block_size = block_size
        self.segment_separator = segment_separator

    def segmented(self, prompt: PromptInput) -> SegmentedPrompt | None:
        """The prompt's segments, or None for an unsegmented prompt."""
        if isinstance(prompt, SegmentedPrompt):
            return prompt
        if isinstance(prompt, dict) and "segments" in prompt:
            return parse_segment_prompt(self.tokenizer, prompt)
        sep = self.segment_separator
        if sep is None:
            return None
        fields = prompt if isinstance(prompt, dict) else {"prompt": prompt}
        text = fields.get("prompt")
        split = split_on_separator(text, sep) if isinstance(text, str) and "prompt_token_ids" not in fields else None
        if split is None:
            return None
        return parse_segment_prompt(self.tokenizer, {**fields, **split})

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        """``(text, token ids, cache salt)`` of any prompt form; ValueError on a bad one."""
        prompt = self.segmented(prompt) or prompt
        if isinstance(prompt, SegmentedPrompt):
            return prompt.text, prompt.token_ids, prompt.cache_salt
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt fields: {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError("cache_salt must be a non-empty string")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False), salt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt), salt
        raise ValueError("a prompt must be a string, a list of token ids, or a dict with 'prompt'")

    def process(self, prompt: PromptInput, cache_salt: str | None = None,
                truncate: int | None = None) -> ProcessedPrompt:
        """Parse, tokenise and validate; ``cache_salt`` (when given) overrides the prompt's.
        ``truncate`` (vLLM's ``truncate_prompt_tokens``): keep the prompt's last ``truncate``
        tokens (-1: the context's length); the text is then dropped (it no longer matches the ids).
        Raises ValueError with a message for the caller on bad input."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        segmented = self.segmented(prompt)
        if segmented is not None and truncate is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with segments")
        text, ids, salt = self.tokenize(segmented or prompt)
        salt = cache_salt if cache_salt is not None else salt
        keep = self.max_model_len if truncate == -1 else truncate
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[-keep:]
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                             f"has {len(ids)}, leaving no room for a completion")
        if len(ids) // self.block_size + 2 > self.max_prompt_blocks:
            raise ValueError(f"the prompt needs more KV blocks than the pool has ({self.max_prompt_blocks})")
        spans = segmented.spans if segmented is not None and segmented.spans else None
        return ProcessedPrompt(text, ids, salt, spans)
