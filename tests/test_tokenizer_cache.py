"""A GGUF's tokenizer converted once and read from disk after (model/tokenizer_cache.py):

* the cached tokenizer is the converted one: the same ids, text, special tokens, chat template;
* the second load does not convert; a changed file has another key;
* an unreadable entry is converted again and replaced; an unwritable cache only costs the conversion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvmosaic.model.loader import shipped_model_path
from kvmosaic.model.tokenizer import load_tokenizer
from kvmosaic.model.tokenizer_cache import cached_gguf_tokenizer, gguf_key

TEXTS = ["Hello world", "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
         "  spaces\n\n\tand ünïcödé, 123 456 — «quotes» 漢字 🙂", ""]


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVMOSAIC_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    return tmp_path / "tokenizers"


def _counting_converter(path: Path):
    calls = []

    def convert():
        calls.append(1)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    return convert, calls


def test_the_cached_tokenizer_is_the_converted_one_and_is_not_converted_again(cache):
    path = Path(shipped_model_path())
    convert, calls = _counting_converter(path)
    first = cached_gguf_tokenizer(path, convert)
    second = cached_gguf_tokenizer(path, convert)
    assert len(calls) == 1 and (cache / gguf_key(path) / "tokenizer.json").is_file()
    for text in TEXTS:
        ids = first.encode(text, add_special_tokens=False)
        assert second.encode(text, add_special_tokens=False) == ids
        assert second.decode(ids) == first.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert second.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        first.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (second.all_special_ids, second.eos_token_id, second.bos_token_id, len(second)) == \
        (first.all_special_ids, first.eos_token_id, first.bos_token_id, len(first))
    assert {i: (t.content, t.special) for i, t in second.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in first.added_tokens_decoder.items()}
    # and the engine's loader takes the cached one
    assert load_tokenizer(str(path.parent), path.name).encode(TEXTS[1]) == first.encode(TEXTS[1])


def test_a_changed_file_has_another_key(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert gguf_key(a) != gguf_key(b)
    b.write_bytes(a.read_bytes())
    assert gguf_key(a) == gguf_key(b)


def test_an_unreadable_entry_is_converted_again_and_replaced(cache):
    path = Path(shipped_model_path())
    convert, calls = _counting_converter(path)
    entry = cache / gguf_key(path)
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{not json")
    tok = cached_gguf_tokenizer(path, convert)
    assert len(calls) == 1 and tok.encode("Hello") == convert().encode("Hello")
    cached_gguf_tokenizer(path, convert)
    assert len(calls) == 2  # the second call above was the comparison's; the load read the new entry


def test_an_unwritable_cache_only_costs_the_conversion(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVMOSAIC_TOKENIZER_CACHE", str(blocker / "tokenizers"))  # no folder can be made there
    path = Path(shipped_model_path())
    convert, calls = _counting_converter(path)
    assert cached_gguf_tokenizer(path, convert).encode("Hello") and len(calls) == 1
