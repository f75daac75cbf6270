"""Tokenizer, chat template and stop tokens through transformers (read from the GGUF, converted once:
tokenizer_cache.py; or from the folder)."""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .tokenizer_cache import cached_gguf_tokenizer


def load_tokenizer(tokenizer_dir: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gguf_file:
            return cached_gguf_tokenizer(Path(tokenizer_dir) / gguf_file,
                                         lambda: AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file))
        return AutoTokenizer.from_pretrained(tokenizer_dir)


#: Chat templates shipped in the package, selectable by name with ``--chat-template NAME``.
SHIPPED_TEMPLATES = {"chatml-tools": "chatml_tools.jinja"}


def resolve_chat_template(value: str | None) -> str | None:
    """A template file path, or the path of a shipped template named ``value``; unknown: as is."""
    if value is None or os.path.isfile(value) or value not in SHIPPED_TEMPLATES:
        return value
    return str(Path(__file__).with_name("templates") / SHIPPED_TEMPLATES[value])


def with_chat_template(tokenizer: PreTrainedTokenizerBase, template_file: str | None) -> PreTrainedTokenizerBase:
    """``tokenizer``, or a copy of it whose chat template is read from ``template_file`` (the
    original is shared by the engines of a process and stays as it is)."""
    if template_file is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = Path(template_file).read_text()
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | None) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's EOS and every ``eos_token_id`` of the
    model folder's ``generation_config.json`` (chat models list their end-of-turn token there,
    e.g. Qwen's ``<|im_end|>`` beside ``<|endoftext|>``, Gemma's ``<end_of_turn>``)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    gen = Path(model_dir) / "generation_config.json" if model_dir else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(int(i) for i in ids))
