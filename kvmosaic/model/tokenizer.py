"""Tokenizer and chat template through transformers (read from the GGUF or the folder)."""

from __future__ import annotations

import os
import warnings

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(tokenizer_dir: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gguf_file:
            return AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(tokenizer_dir)
