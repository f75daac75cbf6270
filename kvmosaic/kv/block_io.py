"""Block I/O between the paged pool and bytes (what the storage tiers store).

A block's payload is its KV in every layer, ``[num_layers, 2, block_size, kv_heads, head_dim]``
(``PagedKVCache.read_block``), as raw bytes in the pool's dtype, C order. The header that goes
with it (:class:`~kvmosaic.tiers.format.BlockMeta`) names the model fingerprint, dtype, block
size, layout and shape, so a load into an engine with any other layout is a miss.

On CUDA the copy out goes through a pinned host buffer with a non-blocking copy followed by a
stream sync (the bytes must be final before the block can be overwritten); the copy in uses a
pinned staging tensor and a non-blocking host-to-device copy. On CPU both are one memcpy.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        return _tensor_bytes(host)

    def write(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        """Put a verified payload (``read``'s format) into block ``block_id``."""
        t = torch.frombuffer(bytearray(payload), dtype=self.kv.dtype).view(self.shape)
        if self.cuda:
            t = t.pin_memory()
            self.kv.buffer[:, :, block_id].copy_(t, non_blocking=True)
        else:
            self.kv.write_block(block_id, t)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # Through uint8 so every dtype (bfloat16 included, which numpy lacks) has a byte view.
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
