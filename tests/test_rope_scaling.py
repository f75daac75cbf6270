"""RoPE scalings and partial rotary against transformers' own tables (``modeling_rope_utils``).

For each parameter set, transformers builds its config and its inverse frequencies and
attention factor; kvmosaic reads the same config (``traits_from_hf``) and must produce the same
tensor bit for bit and the same factor. The models themselves (yarn, longrope, partial rotary)
are checked logit by logit in test_families.py; here also longrope's short factors, which an
engine serving a context within the original length uses (``--max-model-len``).
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvmosaic import SamplingParams
from kvmosaic.model.families import traits_from_hf
from kvmosaic.model.rope_scaling import inv_freq
from tests.conftest import make_llm
from tests.tiny_models import COMMON, LONGROPE, build

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "yarn": ("LlamaConfig", dict(max_position_embeddings=256, rope_parameters=YARN)),
    "yarn-no-truncate": ("LlamaConfig", dict(max_position_embeddings=256, rope_parameters={**YARN, "truncate": False})),
    "yarn-mscale": ("LlamaConfig", dict(max_position_embeddings=256, rope_parameters={
        **YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2})),
    "yarn-attention-factor": ("Qwen2Config", dict(max_position_embeddings=256,
                                                  rope_parameters={**YARN, "attention_factor": 1.3})),
    "longrope": ("Phi3Config", dict(partial_rotary_factor=0.75, original_max_position_embeddings=64,
                                    rope_parameters=LONGROPE)),
    "partial-default": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "llama3-partial": ("LlamaConfig", dict(partial_rotary_factor=0.5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seq_len", [32, 200])
def test_tables_equal_transformers(name, seq_len):
    cls, overrides = CASES[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **overrides})
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":  # transformers 5 keeps it on each model's rotary class
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        ref, ref_factor = Phi3RotaryEmbedding.compute_default_rope_parameters(cfg, "cpu")
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
    rope = traits_from_hf(cfg.to_dict()).rope(0, 10000.0)
    ours = inv_freq(rope, COMMON["head_dim"], max_positions=seq_len)  # the context served picks longrope's set
    assert ours.dtype == torch.float32 and torch.equal(ours, ref.float()), name
    assert rope.attention_factor == pytest.approx(ref_factor or 1.0, rel=1e-12)


def test_longrope_short_factors_within_the_original_context(tmp_path):
    """An engine serving at most the original 64 positions rotates with the short factors, as
    transformers does for every sequence within them: greedy tokens equal and logits within 1e-4
    (the default context, 512, takes the long set, and its first logits differ)."""
    hf = build("phi4-longrope", tmp_path)
    rng = random.Random(5)
    ids = [rng.randrange(256) for _ in range(40)]
    hf.generation_config.eos_token_id = None
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 40, dtype=torch.long), generation_config=gen)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    short = make_llm(model=str(tmp_path), block_size=16, num_kv_blocks=32, max_model_len=64)
    out = short.generate([ids], params)[0]
    assert out.token_ids == ref.sequences[0, 40:].tolist()
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp[tok] - torch.log_softmax(ref.logits[step][0].float(), -1)[tok].item()) < 1e-4, step
    assert short.engine.model is not make_llm(model=str(tmp_path), max_model_len=512).engine.model
    long = make_llm(model=str(tmp_path), block_size=16, num_kv_blocks=32)  # the shared model: long factors
    assert long.generate([ids], params)[0].logprobs[0] != out.logprobs[0]


@pytest.mark.parametrize("extra, words", [({"llama.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn' from GGUF"),
                                          ({"llama.rope.dimension_count": 12}, "partial rotary (12 of 16")])
def test_gguf_refuses_what_it_cannot_say_in_one_line(extra, words):
    """A GGUF header names neither yarn's original context nor llama.cpp's partial-rotary layout
    the way transformers does: refused, where a safetensors folder loads."""
    from kvmosaic.model.gguf_arch import hf_config

    fields = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
              "llama.attention.key_length": 16, "llama.vocab_size": 272, "llama.feed_forward_length": 128,
              "llama.block_count": 2, **extra}
    with pytest.raises(ValueError) as err:
        hf_config(fields, True)
    assert words in str(err.value) and "\n" not in str(err.value)
