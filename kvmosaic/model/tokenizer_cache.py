"""A GGUF's tokenizer, converted once per file and kept on disk.

transformers builds a tokenizer from a GGUF by parsing the whole file's metadata (every vocabulary
entry and merge as its own field) and converting it: ~6 s for the shipped model, paid by every
engine, server, replica and ingress a process starts. The converted tokenizer is saved once
(``save_pretrained``: ``tokenizer.json``, its config and chat template) under
``$KVMOSAIC_TOKENIZER_CACHE`` (default ``~/.cache/kvmosaic/tokenizers``) and read from there
(~0.5 s) afterwards.

Invariants: an entry is keyed by the file's content (its size and a hash of its first
:data:`HEAD_BYTES`, where a GGUF keeps its metadata, the tokenizer included) and the
transformers version that converted it, so a changed file or converter never reads a stale
entry; an entry is written to a temporary folder and renamed into place, so a reader never sees
half of one; an unreadable entry or an unwritable cache only costs the conversion.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .. import paths

log = logging.getLogger("kvmosaic")

HEAD_BYTES = 64 << 20  # a GGUF's metadata (header, key-values, tensor infos) precedes its tensor data


def cache_dir() -> Path:
    return paths.cache_dir("tokenizers", "KVMOSAIC_TOKENIZER_CACHE")


def gguf_key(path: Path) -> str:
    """The cache key of a GGUF file's tokenizer: its size, its first bytes, the converter's version."""
    digest = hashlib.sha256(f"{transformers.__version__}\0{path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
    return digest.hexdigest()[:32]


def cached_gguf_tokenizer(gguf_path: Path, convert: Callable[[], PreTrainedTokenizerBase]) -> PreTrainedTokenizerBase:
    """The tokenizer of the GGUF at ``gguf_path``: from the cache, or ``convert()`` and cached."""
    try:
        entry = cache_dir() / gguf_key(gguf_path)
    except (OSError, RuntimeError):  # RuntimeError: no home folder to put the cache in
        return convert()
    unreadable = False
    if (entry / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except (OSError, ValueError) as exc:
            log.warning("cached tokenizer at %s unreadable (%s): converting the GGUF's again", entry, exc)
            unreadable = True
    tokenizer = convert()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
        tokenizer.save_pretrained(str(staging))
        if unreadable:
            shutil.rmtree(entry, ignore_errors=True)
        try:
            staging.rename(entry)
        except OSError:  # another process put its copy there first: it stays, read by the next start
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        log.info("tokenizer cache not written (%s): the next start converts the GGUF's again", exc)
    return tokenizer
