"""A GGUF's index parsed once and read from disk after (model/gguf_index.py):

* weights loaded through a cached index are the parsed load's, bit for bit (config, tensors, the
  Q4_1 / Q8_0 blocks, end-of-turn ids), and the second load does not parse;
* the key follows the file's content, not its name;
* an unreadable entry (not JSON, or a tensor outside the file) is parsed again and replaced;
  an unwritable cache only costs the parse.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmosaic.model import gguf_index as index_module
from kvmosaic.model.gguf_index import cache_dir, gguf_index, index_key
from kvmosaic.model.loader import LoadedWeights, load_weights, weights_fingerprint
from tests.tiny_gguf import write_gguf
from tests.tiny_models import build


@pytest.fixture()
def parses(tmp_path, monkeypatch) -> list[Path]:
    """An empty cache, and the files gguf-py's reader parsed."""
    monkeypatch.setenv("KVMOSAIC_GGUF_CACHE", str(tmp_path / "gguf-cache"))
    calls: list[Path] = []
    parse = index_module.parse

    def counting(path: Path):
        calls.append(path)
        return parse(path)

    monkeypatch.setattr(index_module, "parse", counting)
    return calls


def assert_same(a: LoadedWeights, b: LoadedWeights) -> None:
    assert (a.config, a.stop_token_ids, a.fingerprint, a.name, a.formats) == \
        (b.config, b.stop_token_ids, b.fingerprint, b.name, b.formats)
    for field in ("tensors", "q4_1_blocks", "q8_0_blocks"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), field


def test_the_shipped_model_loads_the_same_through_its_cached_index(parses):
    parsed = load_weights(None, keep_q4_1=True)
    indexed = load_weights(None, keep_q4_1=True)
    assert len(parses) == 1 and (cache_dir() / f"{index_key(parses[0])}.json").is_file()
    assert_same(parsed, indexed)
    assert indexed.q4_1_blocks and indexed.q8_0_blocks
    assert indexed.fingerprint == weights_fingerprint(None)  # the one the tiers and tools name blocks by


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama 3 GGUF: float32 tensors and a rope_freqs tensor (read into the config)."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_gguf(build("llama3-rope", folder), "llama", folder / "model.gguf")


def test_a_tiny_llama3_file_with_rope_factors_loads_the_same(parses, tiny):
    parsed, indexed = load_weights(str(tiny)), load_weights(str(tiny))
    assert len(parses) == 1
    assert_same(parsed, indexed)
    assert parsed.config.traits.ropes  # the file's rope_freqs tensor reached the config both times


def test_the_key_follows_the_content(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(100))
    c.write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert index_key(a) == index_key(b) != index_key(c)


@pytest.mark.parametrize("damage", ["not-json", "outside-the-file"])
def test_an_unreadable_entry_is_parsed_again_and_replaced(parses, tiny, damage):
    path = tiny
    good = gguf_index(path)
    entry = cache_dir() / f"{index_key(path)}.json"
    text = entry.read_text()
    if damage == "not-json":
        entry.write_text(text[: len(text) // 2])
    else:
        last = good.tensors[-1]
        entry.write_text(text.replace(f'"offset": {last.offset}', f'"offset": {path.stat().st_size}'))
    assert gguf_index(path) == good and len(parses) == 2
    assert gguf_index(path) == good and len(parses) == 2  # the entry was replaced


def test_an_unwritable_cache_only_costs_the_parse(parses, tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVMOSAIC_GGUF_CACHE", str(blocker / "gguf"))  # no folder can be made there
    assert gguf_index(tiny) == gguf_index(tiny) and len(parses) == 2


def test_the_index_views_the_files_bytes(parses, tiny, tmp_path):
    """A copy of the file under another name uses the same entry, and its tensors are read from
    the copy."""
    path = tiny
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    first = dict((t.name, a) for t, a in gguf_index(path).arrays(path))
    second = dict((t.name, a) for t, a in gguf_index(copy).arrays(copy))
    assert len(parses) == 1 and first.keys() == second.keys()
    name = next(iter(first))
    assert (first[name] == second[name]).all() and Path(second[name].base.filename) == copy


def test_no_home_folder_only_costs_the_parse(parses, tiny, monkeypatch):
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("KVMOSAIC_GGUF_CACHE")
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    assert gguf_index(tiny) == gguf_index(tiny) and len(parses) == 2


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "gguf-py"])
def test_every_tensor_dequantizes_to_gguf_pys_bits(shipped_gguf, kernels_on, monkeypatch):
    """The loader's Q4_1 kernel and torch Q8_0 give gguf-py's float32 weights exactly, and the
    load without the kernels (no compiler, ``KVMOSAIC_KERNELS=0``) is the same."""
    from gguf import GGMLQuantizationType, dequantize

    from kvmosaic.model import kernels, loader
    from kvmosaic.model.gguf_index import file_sha256

    if not kernels_on:
        monkeypatch.setattr(kernels, "q4_1_available", lambda: False)
    path = Path(shipped_gguf)
    seen = set()
    for t, data in gguf_index(path, file_sha256(path)).arrays(path):
        seen.add(t.quant_type)
        got = loader._dequantize(data, t.quant_type)
        assert got.dtype == "float32"
        want = dequantize(data, t.quant_type).astype(np.float32)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0} <= seen
