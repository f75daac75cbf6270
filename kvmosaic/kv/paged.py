"""The paged KV pool: one allocation, fixed-size blocks, per-layer views.

Layout: ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``. A token's
KV lives at *slot* ``block_id * block_size + offset`` of every layer; attention reads a
sequence's context through the slots its block table names. K is stored after RoPE.

With a hybrid layout (``cache/kv_groups.py``) the first axis has ``page_layers`` rows and a
block is a *page* of one layer group: layer ``l`` reads and writes row ``row_of[l]``, through
the slots of its group's block table, so groups hold pages independently.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..cache.kv_groups import KVLayout


class KVShape(Protocol):
    """What the pool needs to know of a model (``model.config.ModelConfig`` has it): kv sits
    beside model in the layers, so it names the shape, not the model's class."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int: ...


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    def __init__(
        self,
        config: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layout: KVLayout | None = None,
    ) -> None:
        self.config = config
        self.layout = layout or KVLayout.full(config.num_layers)
        rows = self.layout.page_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffer = torch.zeros(
            rows, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=self.device,
        )
        # Flat per-layer views: [num_slots, kv_heads, head_dim], indexed by slot.
        kv = self.buffer.view(rows, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        row_of = self.layout.row_of
        self.k = [kv[row_of[i], 0] for i in range(config.num_layers)]
        self.v = [kv[row_of[i], 1] for i in range(config.num_layers)]

    @staticmethod
    def num_blocks_for_budget(config: KVShape, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        return max(1, budget_bytes // (config.kv_bytes_per_token(dtype_bytes(dtype)) * block_size))

    @property
    def bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(dtype_bytes(self.dtype))

    @property
    def page_bytes(self) -> int:
        """Bytes of one block (page) of the pool: ``page_layers`` layers' K and V."""
        return self.nbytes // self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slots(self, block_table: list[int] | torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Slots of a sequence's first ``num_tokens`` tokens, through its block table."""
        table = torch.as_tensor(block_table, dtype=torch.long)
        return (table[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)[:num_tokens]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[tokens, kv_heads, head_dim]`` at ``slots``."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first n slots of block src into block dst, every layer (copy-on-write)."""
        for src, dst, n in copies:
            self.buffer[:, :, dst, :n] = self.buffer[:, :, src, :n]

    def read_block(self, block_id: int) -> torch.Tensor:
        """A block's KV in every layer: ``[num_layers, 2, block_size, kv_heads, head_dim]``."""
        return self.buffer[:, :, block_id]

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        self.buffer[:, :, block_id] = data.to(self.buffer.device, self.buffer.dtype)
