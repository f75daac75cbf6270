"""Block I/O between the paged pool and bytes (what the storage tiers store).

A block's payload is its KV in every layer, ``[num_layers, 2, block_size, kv_heads, head_dim]``
(``PagedKVCache.read_block``), as raw bytes in the pool's dtype, C order. The header that goes
with it (:class:`~kvmosaic.tiers.format.BlockMeta`) names the model fingerprint, dtype, block
size, layout and shape, so a load into an engine with any other layout is a miss.

On CUDA the copy out goes through a pinned host buffer with a non-blocking copy followed by a
stream sync (the bytes must be final before the block can be overwritten); the copy in uses a
pinned staging tensor and a non-blocking host-to-device copy. On CPU both are one memcpy.

:func:`nonfinite` is the tier stack's ``payload_check`` (kv/tiered.py): a verified payload with a
NaN or an infinity (a writer holding the key, or a broken one) is rejected like a corrupt entry
(counted as "nonfinite", deleted, a miss) before it can reach attention. It reads the bytes in
place (numpy views, no copy): IEEE formats are non-finite exactly when every exponent bit is set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..tiers.format import BlockMeta
from .paged import PagedKVCache

LAYOUT = "L,2,B,H,D"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BlockIO:
    """Copies whole blocks of one pool to and from bytes, and names their format."""

    def __init__(self, kv: PagedKVCache, fingerprint: str) -> None:
        self.kv = kv
        self.fingerprint = fingerprint
        cfg = kv.config
        self.shape = (cfg.num_layers, 2, kv.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.dtype = dtype_name(kv.dtype)
        self.cuda = kv.device.type == "cuda"
        self._staging: torch.Tensor | None = None
        if self.cuda:
            self._staging = torch.empty(self.shape, dtype=kv.dtype, pin_memory=True)

    @property
    def block_nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.kv.buffer.element_size()

    def meta(self, block_hash: bytes, token_ids: Sequence[int]) -> BlockMeta:
        return BlockMeta(self.fingerprint, self.dtype, self.kv.block_size, LAYOUT, self.shape,
                         tuple(int(t) for t in token_ids), block_hash)

    def read(self, block_id: int) -> bytes:
        """The block's KV as bytes (a copy: the block may be overwritten right after)."""
        src = self.kv.read_block(block_id)
        if self.cuda:
            assert self._staging is not None
            self._staging.copy_(src, non_blocking=True)
            torch.cuda.current_stream(self.kv.device).synchronize()
            host = self._staging
        else:
            host = src.contiguous()
        return tensor_bytes(host)

    def write(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        """Put a verified payload (``read``'s format) into block ``block_id``."""
        t = torch.frombuffer(bytearray(payload), dtype=self.kv.dtype).view(self.shape)
        if self.cuda:
            t = t.pin_memory()
            self.kv.buffer[:, :, block_id].copy_(t, non_blocking=True)
        else:
            self.kv.write_block(block_id, t)


#: dtype -> (unsigned view, mask, value): an element is non-finite when ``x & mask == value``.
_NONFINITE_BITS = {
    "bfloat16": (np.uint16, 0x7F80, 0x7F80),
    "float8_e5m2": (np.uint8, 0x7C, 0x7C),
    "float8_e4m3fn": (np.uint8, 0x7F, 0x7F),  # no infinities; NaN is S.1111.111
}
_NUMPY_FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def nonfinite(meta: BlockMeta, payload: bytes | bytearray | memoryview) -> str | None:
    """"nonfinite" if the payload (in ``meta.dtype``) holds a NaN or an infinity, else None."""
    if meta.dtype in _NUMPY_FLOATS:
        ok = bool(np.isfinite(np.frombuffer(payload, dtype=_NUMPY_FLOATS[meta.dtype])).all())
    elif meta.dtype in _NONFINITE_BITS:
        view, mask, value = _NONFINITE_BITS[meta.dtype]
        ok = not bool(((np.frombuffer(payload, dtype=view) & mask) == value).any())
    else:
        ok = True  # integer payloads (and unknown dtypes) have no non-finite values
    return None if ok else "nonfinite"


def tensor_bytes(t: torch.Tensor) -> bytes:
    """``t``'s bytes in memory order, from any device (copied to the host first)."""
    # Through uint8 so every dtype (bfloat16 included, which numpy lacks) has a byte view.
    return t.contiguous().cpu().view(torch.uint8).reshape(-1).numpy().tobytes()
