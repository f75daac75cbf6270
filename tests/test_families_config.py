"""Reading a config.json into families.Traits: which layers slide (against transformers' own
resolution of the same config), and what is refused — in one line, before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from kvmosaic.model.families import SUPPORTED, traits_from_hf

WINDOW_CASES = {
    "qwen2-off": ("Qwen2Config", dict(sliding_window=4096, use_sliding_window=False, max_window_layers=2)),
    "qwen2-on": ("Qwen2Config", dict(sliding_window=64, use_sliding_window=True, max_window_layers=2)),
    "qwen3-on": ("Qwen3Config", dict(sliding_window=64, use_sliding_window=True, max_window_layers=1)),
    "mistral-window": ("MistralConfig", dict(sliding_window=64)),
    "mistral-none": ("MistralConfig", dict(sliding_window=None)),
    "phi3-window": ("Phi3Config", dict(sliding_window=2047, pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(sliding_window=64)),
    "gemma3-pattern6": ("Gemma3TextConfig", dict(sliding_window=512)),
    "gemma3-pattern3": ("Gemma3TextConfig", dict(sliding_window=512, sliding_window_pattern=3)),
}


def hf_windows(cls_name: str, kwargs: dict):
    """The config as transformers writes it, and each layer's window as its attention sees it."""
    import transformers

    cfg = getattr(transformers, cls_name)(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    windows = tuple(getattr(layer.self_attn, "sliding_window", cfg.sliding_window) for layer in model.model.layers)
    return json.loads(cfg.to_json_string()), windows


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_window_per_layer_as_transformers(case):
    written, windows = hf_windows(*WINDOW_CASES[case])
    expected = windows if any(windows) else ()
    assert traits_from_hf(written).windows == expected
    older = {k: v for k, v in written.items() if k != "layer_types"}  # files written before layer_types
    assert traits_from_hf(older).windows == expected


def test_gemma3_rope_bases_per_layer_type():
    written, _ = hf_windows("Gemma3TextConfig", dict(sliding_window=512, sliding_window_pattern=3))
    thetas = tuple(r.theta for r in traits_from_hf(written).ropes)
    assert thetas == (10000.0, 10000.0, 1e6, 10000.0, 10000.0, 1e6, 10000.0)
    older = {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
    older.update(rope_theta=1e6, rope_local_base_freq=10000.0)  # the transformers 4 fields
    assert tuple(r.theta for r in traits_from_hf(older).ropes) == thetas


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "gpt2", "num_hidden_layers": 2}, "architecture 'gpt2' is not supported; supported: "
                                                     + ", ".join(SUPPORTED)),
    ({"model_type": "llama", "num_hidden_layers": 2, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
     "RoPE type 'dynamic' is not supported yet; supported: default, linear, llama3, yarn, longrope"),
    ({"model_type": "llama", "num_hidden_layers": 2, "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "gemma3_text", "num_hidden_layers": 2, "use_bidirectional_attention": True}, "bidirectional"),
])
def test_refused_in_one_line(cfg, words):
    with pytest.raises(ValueError) as err:
        traits_from_hf({"hidden_size": 32, **cfg})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_before_loading(tmp_path, capsys):
    """``kvmosaic serve --model`` with an unsupported folder: a one-line error, no traceback,
    before any weight is read (the folder has none)."""
    from kvmosaic.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tmp_path)])
    assert str(exit_.value).startswith("kvmosaic serve: error: architecture 'gpt2' is not supported; supported: llama")
    with pytest.raises(ValueError, match="does not exist"):
        from kvmosaic.engine.config import EngineConfig

        EngineConfig(model=str(tmp_path / "missing"))


def test_segment_reuse_refused_for_windowed_models(tmp_path):
    from kvmosaic.engine.config import EngineConfig
    from tests.tiny_models import hf_config

    (tmp_path / "config.json").write_text(hf_config("gemma3").to_json_string())
    with pytest.raises(ValueError, match="segment reuse is not supported for gemma3_text models"):
        EngineConfig(model=str(tmp_path), segment_reuse="blend")
    EngineConfig(model=str(tmp_path))  # the model itself is accepted


def test_multimodal_gemma3_text_config_filled_with_transformers_defaults():
    """gemma-3-4b-it's config.json lists six keys of its text model; the rest are defaults."""
    from kvmosaic.model.config import ModelConfig

    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    mc = ModelConfig.from_hf_dict(cfg)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (8, 4, 256, 262208)
    t = mc.traits
    assert t.windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert {(r.theta, r.kind, r.factor) for r in t.ropes} == {(10000.0, "default", 1.0), (1e6, "linear", 8.0)}
    assert t.attn_scale == 256**-0.5 and t.embed_scale == 2560**0.5 and mc.tie_word_embeddings
