"""Every supported family against transformers on the same weights (float32).

For each family a tiny model is built by transformers from a config with fixed-seed random
weights and saved as safetensors (``tests/tiny_models.py``); kvmosaic loads the folder. Checked:

* prefill logits at every position, read through a shuffled block table: max abs difference
  below ``PREFILL_TOL`` (measured: 0.0 for every family on this machine; the bound leaves room
  for other kernels);
* 32 greedy tokens and the logits of every step equal to ``transformers.generate``'s (within
  ``STEP_TOL``), with the prefix cache off, hash and radix, and with chunked prefill; prompts
  run past the sliding windows, later prompts hit a cached prefix that ends inside their
  window, and they decode together over a shared prefix (cascade attention on full layers).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from kvmosaic import SamplingParams
from kvmosaic.kv.paged import PagedKVCache
from kvmosaic.model import load_model_bundle
from kvmosaic.model.attention import AttentionMetadata, PrefillSpan
from tests.conftest import make_llm, record_logits
from tests.tiny_models import FAMILIES, build

PREFILL_TOL = 1e-4
STEP_TOL = 1e-4
NEW_TOKENS = 32
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is 10x faster than two on a busy 2-core machine (OpenMP workers
    waiting for a core); restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, transformers model) for one tiny family checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), build(request.param, path)


def prompts() -> list[list[int]]:
    """A first prompt (90 tokens: past every window), then three that share its first 69
    tokens (4 full blocks and 5 tokens: the hit ends inside their windows) with distinct tails,
    and one equal to the first (a full hit)."""
    rng = random.Random(7)
    draw = lambda k: [rng.randrange(256) for _ in range(k)]  # noqa: E731
    first = draw(90)
    return [first] + [first[:69] + draw(k) for k in (30, 41, 52)] + [list(first)]


_REFERENCE: dict[tuple[str, int], tuple[list[int], list[torch.Tensor]]] = {}


def reference(name: str, hf, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and raw logits of each step (memoised per family)."""
    key = (name, hash(tuple(ids)))
    if key not in _REFERENCE:
        hf.generation_config.eos_token_id = None  # generate all 32 tokens, as ignore_eos does
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              generation_config=gen)
        assert out.sequences.shape[1] == len(ids) + NEW_TOKENS
        _REFERENCE[key] = (out.sequences[0, len(ids):].tolist(), [x[0].float() for x in out.logits])
    return _REFERENCE[key]


def test_prefill_logits_match_transformers(family):
    name, path, hf = family
    bundle = load_model_bundle(path, "float32", "cpu")
    ids = prompts()[0] + prompts()[1][69:]
    n = len(ids)
    num_blocks = -(-n // BLOCK) + 3
    kv = PagedKVCache(bundle.config, num_blocks, BLOCK, torch.float32)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n]
    ours = bundle.model(torch.tensor(ids), torch.arange(n), kv, AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    assert diff < PREFILL_TOL, f"{name}: max abs logit difference {diff}"


def count_cascades(llm) -> list[int]:
    """How many decode steps ran with a shared prefix attended once (cascade groups)."""
    runner, count = llm.engine.runner, [0]
    build_batch = runner._decode_batch

    def wrapped(*args):
        d = build_batch(*args)
        count[0] += bool(d.shared)
        return d

    runner._decode_batch = wrapped
    return count


MODES = {
    "no-cache": dict(prefix_cache="none"),
    "hash": dict(prefix_cache="hash"),
    "radix": dict(prefix_cache="radix"),
    "hash-chunked": dict(prefix_cache="hash", max_num_batched_tokens=24),
    "radix-chunked": dict(prefix_cache="radix", max_num_batched_tokens=24),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_steps_match_transformers(family, mode, monkeypatch):
    import kvmosaic.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "cascade_pays", lambda model, kv: True)  # cascade even beside the kernel
    name, path, hf = family
    llm = make_llm(model=path, block_size=BLOCK, num_kv_blocks=64, **MODES[mode])
    logits = record_logits(llm)
    cascades = count_cascades(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ps = prompts()
    outs = llm.generate(ps[:1], params) + llm.generate(ps[1:], params)  # the rest hit the first
    for i, (ids, out) in enumerate(zip(ps, outs)):
        tokens, ref_logits = reference(name, hf, ids)
        assert out.token_ids == tokens, f"{name} {mode}: prompt {i} diverges from transformers"
        steps = logits[out.request_id]
        assert len(steps) == NEW_TOKENS
        diff = max((a - b).abs().max().item() for a, b in zip(steps, ref_logits))
        assert diff < STEP_TOL, f"{name} {mode}: prompt {i}, max abs logit difference {diff}"
    cached = [o.num_cached_tokens for o in outs[1:]]
    if mode == "no-cache":
        assert cached == [0, 0, 0, 0]
    else:
        assert min(cached[:3]) >= 64 and cached[3] >= 80, cached  # hits reach into the windows
        if any(g.window is None for g in llm.engine.kv_layout.groups):  # all windowed: no full group to cascade
            assert cascades[0] > 0, "the shared-prefix decodes never ran as a cascade"


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "int8")])
def test_bfloat16_and_int8_stay_near_float32(family, dtype, quantization):
    """The other compute paths (bfloat16 with packed weights, int8 weight-only projections with
    the qkv bias kept apart) run every family's switches: logits stay near float32's (measured:
    max abs difference 0.05-0.32 on logits of std ~1.2; argmax agreeing at >= 95% of positions)."""
    name, path, _ = family
    ids = torch.tensor(prompts()[0])
    n = ids.numel()
    out = []
    for dt, quant in (("float32", None), (dtype, quantization)):
        bundle = load_model_bundle(path, dt, "cpu", quant)
        kv = PagedKVCache(bundle.config, -(-n // BLOCK), BLOCK, getattr(torch, dt))
        slots = torch.arange(n)
        out.append(bundle.model(ids, torch.arange(n), kv, AttentionMetadata(slots, [PrefillSpan(0, n, slots, None)])))
    assert (out[0] - out[1]).abs().max().item() < 0.5, name
    assert (out[0].argmax(-1) == out[1].argmax(-1)).float().mean().item() >= 0.9, name
