"""Shared fixtures. Engines in one process share the built model (see load_model_bundle),
so each extra engine costs only its KV pool."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(scope="session")
def shipped_gguf() -> str:
    from kvmosaic.model.loader import shipped_model_path

    return shipped_model_path()


@pytest.fixture(scope="session")
def hf_model(shipped_gguf):
    """transformers' own Llama on the same GGUF weights: the reference nobody here wrote."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(shipped_gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(shipped_gguf):
    from kvmosaic.model import load_model_bundle

    return load_model_bundle(None, "float32", "cpu").tokenizer


def make_llm(**kwargs):
    from kvmosaic import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(**kwargs)


def record_logits(llm) -> dict[str, list[torch.Tensor]]:
    """Wrap the real runner to keep the logits each request sampled from, step by step."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = llm.engine.runner
    execute = runner.execute

    def wrapped(batch):
        result = execute(batch)
        for row, s in enumerate(result.sampling):
            seen.setdefault(s.seq.request_id, []).append(result.logits[row].clone())
        return result

    runner.execute = wrapped
    return seen
