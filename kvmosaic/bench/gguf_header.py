"""A GGUF file's header alone — metadata scalars and tensor infos — read in a fraction of a
second (``gguf.GGUFReader`` builds an object for each of the tokenizer's ~100k strings first,
tens of seconds on a busy 2-core machine). Arrays are skipped, not returned.

Guarantees: the layout is the GGUF v2/v3 specification's (little-endian); a tensor's stored bytes
are its element count over the type's block size times the block's bytes
(``gguf.GGML_QUANT_SIZES``); a file that is not GGUF raises ``ValueError``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str  # e.g. "Q4_1", "F32"
    n_elements: int
    n_bytes: int


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return None
        return self.take(_SCALARS[vtype])


def read_header(path: Path, max_bytes: int = 64 << 20) -> tuple[dict, list[TensorInfo]]:
    """(metadata scalars and strings by key, tensor infos) of the GGUF file at ``path``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        data = f.read(max_bytes)
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    c = _Cursor(data)
    c.pos = 4
    c.take("<I")  # version
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    fields = {}
    for _ in range(n_kv):
        key = c.string()
        value = c.value(c.take("<I"))
        if value is not None:
            fields[key] = value
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        shape = tuple(c.take("<Q") for _ in range(c.take("<I")))
        qtype = GGMLQuantizationType(c.take("<I"))
        c.take("<Q")  # offset
        n = 1
        for d in shape:
            n *= d
        block, size = GGML_QUANT_SIZES[qtype]
        tensors.append(TensorInfo(name, shape, qtype.name, n, n // block * size))
    return fields, tensors
