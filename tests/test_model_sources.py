"""Where a model comes from and what it brings along: ``org/name`` from the local Hugging Face
cache (offline; a miss says where it looked), the folder's chat template and
``--chat-template FILE`` over it, and the stop tokens of its ``generation_config.json``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvmosaic import SamplingParams
from tests.conftest import make_llm
from tests.tiny_models import build

FOLDER_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
FILE_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 folder whose tokenizer carries a chat template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    build("qwen2", path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = FOLDER_TEMPLATE
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_model_by_id_from_the_local_hub_cache(tiny, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--kvm--tiny-qwen2" / "snapshots" / "0123abcd"
    shutil.copytree(tiny, snapshot)
    (tmp_path / "hub" / "models--kvm--tiny-qwen2" / "refs").mkdir()
    (tmp_path / "hub" / "models--kvm--tiny-qwen2" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = make_llm(model="kvm/tiny-qwen2", num_kv_blocks=16)
    assert llm.engine.model_name == "kvm/tiny-qwen2"
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4

    from kvmosaic.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "kvm/missing"])
    message = str(exit_.value)
    assert message.startswith("kvmosaic serve: error: model 'kvm/missing' is neither a path nor in the Hugging Face cache")
    assert str(tmp_path / "hub" / "models--kvm--missing") in message and "\n" not in message


def test_chat_template_from_the_folder_and_from_a_file(tiny, tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    llm = make_llm(model=str(tiny), num_kv_blocks=16)
    assert llm.apply_chat_template(messages) == "[user] hi\n[assistant] "
    template = tmp_path / "template.jinja"
    template.write_text(FILE_TEMPLATE)
    other = make_llm(model=str(tiny), num_kv_blocks=16, chat_template=str(template))
    assert other.apply_chat_template(messages) == "<user>hi</user><assistant>"
    assert llm.apply_chat_template(messages) == "[user] hi\n[assistant] "  # the shared tokenizer kept its own
    with pytest.raises(ValueError, match="chat template file"):
        make_llm(model=str(tiny), chat_template=str(tmp_path / "missing.jinja"))


def test_stop_tokens_from_generation_config(tiny, tmp_path):
    """An id listed in generation_config.json's eos_token_id ends a generation as EOS does."""
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    free = make_llm(model=str(tiny), num_kv_blocks=16).generate([prompt], params)[0].token_ids
    assert len(free) == 12
    k = next(i for i in range(2, 12) if free[i] not in free[:i])  # first fresh token from the third on
    folder = tmp_path / "with-stops"
    shutil.copytree(tiny, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, free[k]]}))
    out = make_llm(model=str(folder), num_kv_blocks=16).generate([prompt], params)[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop" and out.stop_reason is None
