"""A GGUF file's index — the metadata fields the loader reads and where each tensor's bytes lie —
parsed once per file and kept on disk.

gguf-py's ``GGUFReader`` parses every metadata field, each vocabulary entry and merge its own,
before it names a tensor: ~4 s for the shipped model, paid by every engine, server, replica and
ingress a process starts (and by ``check_model``, which wants one field). The index — the fields
minus the tokenizer's tables (the tokenizer has its own cache: tokenizer_cache.py) and each
tensor's type, offset, dtype and shape — is written once under ``$KVMOSAIC_GGUF_CACHE`` (default
``~/.cache/kvmosaic/gguf``) as JSON; later starts map the file and view each tensor's bytes where
the index says (~0.1 s, the file's hash included).

Invariants: an entry is keyed by the file's content (a SHA-256 of all of it), gguf-py's version
and this module's source, so a changed file, parser or choice of fields never reads a stale
entry; a tensor is a view of the file's bytes with the dtype and shape the reader gave it, so an
indexed load is the parsed load bit for bit; an entry is written whole (a temporary file renamed
into place); an unreadable entry or an unwritable cache only costs the parse.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .. import paths

log = logging.getLogger("kvmosaic")

STOP_FIELDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# of the tokenizer's fields, those the loader reads (the vocabulary's length gives the config's
# vocab_size where the header has none)
TOKENIZER_FIELDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens",
                    *STOP_FIELDS)


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor's data lies: ``shape`` and ``dtype`` are those of the reader's array
    (for a quantized type: uint8, the last dimension in bytes)."""

    name: str
    type: str  # a gguf.GGMLQuantizationType name
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def quant_type(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.type]


@dataclass(frozen=True)
class GGUFIndex:
    fields: dict  # key -> value, as gguf-py's field.contents() gives them
    tensors: tuple[TensorPlace, ...]

    def arrays(self, path: Path) -> Iterator[tuple[TensorPlace, np.ndarray]]:
        """Each tensor with its bytes in ``path``, read-only views of one mapping of the file."""
        data = np.memmap(path, mode="r")
        for t in self.tensors:
            yield t, np.ndarray(t.shape, np.dtype(t.dtype), buffer=data, offset=t.offset)


def cache_dir() -> Path:
    return paths.cache_dir("gguf", "KVMOSAIC_GGUF_CACHE")


def file_sha256(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def index_key(path: Path, content: bytes | None = None) -> str:
    """The cache key of a GGUF file's index: its content (``content``: the file's SHA-256, when
    the caller has it), the parser's version, this module."""
    digest = hashlib.sha256(f"{importlib.metadata.version('gguf')}\0".encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(content if content is not None else file_sha256(path))
    return digest.hexdigest()[:32]


def parse(path: Path) -> GGUFIndex:
    """The index, from gguf-py's reader (the slow way)."""
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in TOKENIZER_FIELDS:
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types we never read
            continue
    tensors = tuple(TensorPlace(t.name, t.tensor_type.name, int(t.data_offset), tuple(int(n) for n in t.data.shape),
                                t.data.dtype.str) for t in reader.tensors)
    return GGUFIndex(fields, tensors)


def gguf_index(path: Path, content: bytes | None = None) -> GGUFIndex:
    """The index of the GGUF at ``path``: from the cache, or parsed and cached. ``content``: the
    file's SHA-256, when the caller has it (see :func:`index_key`)."""
    try:
        entry = cache_dir() / f"{index_key(path, content)}.json"
    except (OSError, RuntimeError):  # RuntimeError: no home folder to put the cache in
        return parse(path)
    if entry.is_file():
        try:
            return _checked(_read(entry), path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cached GGUF index %s unreadable (%s): parsing the file again", entry, exc)
    index = parse(path)
    try:
        _write(entry, index)
    except (OSError, TypeError, ValueError) as exc:  # TypeError / ValueError: a field JSON cannot hold
        log.info("GGUF index not cached (%s): the next start parses the file again", exc)
    return index


def _read(entry: Path) -> GGUFIndex:
    raw = json.loads(entry.read_text())
    tensors = tuple(TensorPlace(t["name"], t["type"], int(t["offset"]), tuple(int(n) for n in t["shape"]),
                                str(t["dtype"])) for t in raw["tensors"])
    return GGUFIndex(dict(raw["fields"]), tensors)


def _checked(index: GGUFIndex, path: Path) -> GGUFIndex:
    """``index`` if each of its tensors lies inside the file with a known type and dtype."""
    size = path.stat().st_size
    for t in index.tensors:
        if t.type not in gguf.GGMLQuantizationType.__members__:
            raise ValueError(f"tensor {t.name}: unknown type {t.type}")
        end = t.offset + int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        if t.offset < 0 or end > size:
            raise ValueError(f"tensor {t.name} lies outside the file")
    return index


def _write(entry: Path, index: GGUFIndex) -> None:
    text = json.dumps({"fields": index.fields, "tensors": [t.__dict__ for t in index.tensors]}, allow_nan=True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=entry.name + ".", dir=entry.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(staging, entry)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
