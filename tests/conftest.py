"""Shared fixtures. Engines in one process share the built model (see load_model_bundle),
so each extra engine costs only its KV pool."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=DeprecationWarning)

# Where make_llm's engines run: "cpu" (CI), or "cuda" to run the engine-level suites on a GPU
# (tests/test_cuda.py has the checks that need one; docs/ARCHITECTURE.md, "Devices").
TEST_DEVICE = os.environ.get("KVMOSAIC_TEST_DEVICE", "cpu")


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
    kwargs.setdefault("device", TEST_DEVICE)
    kwargs.setdefault("num_kv_blocks", 256)
    # A fixed thread count: comparisons of outputs (cache on / off, alone / batched) hold at any
    # given count; oneDNN's float32 GEMMs sum in another order at another count, which the thread
    # budget would pick step by step from the machine's load (tests/test_threads.py states that
    # tolerance on its own).
    kwargs.setdefault("adaptive_threads", False)
    return LLM(**kwargs)


def record_logits(llm) -> dict[str, list[torch.Tensor]]:
    """Wrap the real runner to keep the logits each request sampled from, step by step."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = llm.engine.runner
    execute = runner.execute

    def wrapped(batch):
        result = execute(batch)
        for row, s in enumerate(result.sampling):
            seen.setdefault(s.seq.request_id, []).append(result.logits[row].cpu().clone())
        return result

    runner.execute = wrapped
    return seen


@functools.cache
def packed_gemm_rows_invariant(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU's oneDNN packed GEMM in ``dtype`` gives a row the same bits whatever the
    number of rows in the call, at the shipped model's projection shapes. AVX-512 CPUs without AMX
    do (then a prompt's rows are the same bits whether its past came from the cache or not); on an
    AMX Xeon, past 32 rows the bfloat16 GEMM takes its tile kernel and a row's result changes."""
    if not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    for n_in, n_out in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n_out, n_in, generator=g).to(dtype), None)
        x = torch.randn(96, n_in, generator=g).to(dtype)
        whole = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        for rows in (2, 7, 32, 33, 64):  # a prompt span; one row is a decode's (the fused step)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], ""), whole[:rows]):
                return False
    return True


def assert_greedy_within(tol: float, a_tokens: list[list[int]], b_tokens: list[list[int]],
                         a_logits: list[list[torch.Tensor]], b_logits: list[list[torch.Tensor]]) -> None:
    """Two greedy runs of the same streams agree up to a stated logit tolerance: while their tokens
    agree, every logit of b is within ``tol`` of a's; where they part, a's token was a near tie, its
    lead over the runner-up within ``2 * tol`` (the most two logits that each moved by ``tol`` can
    change their order)."""
    for a_tok, b_tok, a_log, b_log in zip(a_tokens, b_tokens, a_logits, b_logits, strict=True):
        agree = next((i for i, (x, y) in enumerate(zip(a_tok, b_tok)) if x != y), len(a_tok))
        for step in range(min(agree + 1, len(a_tok))):  # the logits that chose the same tokens so far
            diff = (a_log[step] - b_log[step]).abs().max().item()
            assert diff <= tol, f"step {step}: logits differ by {diff} (tolerance {tol})"
        if agree < len(a_tok):
            top2 = a_log[agree].topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin <= 2 * tol, f"step {agree}: a token with a {margin:.3f} lead changed"
