"""Prompt-cache reuse for transformers, as its docs suggest: keep the ``DynamicCache`` of
earlier prompts, and for a new prompt start from a deep copy of the one sharing the longest
prefix, cropped to that prefix. Entries are kept least-recently-used first within a byte budget.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

from ..cache.radix_tree import common_prefix_len


class PromptCacheStore:
    def __init__(self, bytes_per_token: int, capacity_bytes: int = 1 << 30) -> None:
        self.bytes_per_token = bytes_per_token
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[int, ...], object] = OrderedDict()

    def lookup(self, prompt_ids: list[int]):
        """``(cache, n)``: a private cache holding the first ``n`` prompt tokens (at most all but
        the last, whose logits are needed), or ``(None, 0)``."""
        best, best_len = None, 0
        for key in self.entries:
            n = min(common_prefix_len(key, prompt_ids), len(prompt_ids) - 1)
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        cache = copy.deepcopy(self.entries[best])
        extra = cache.get_seq_length() - best_len
        if extra > 0:
            cache.crop(-extra)  # transformers 5: a negative count of tokens to drop
        return cache, best_len

    def insert(self, token_ids: list[int], cache) -> None:
        """Keep ``cache`` (holding the KV of ``token_ids``); drop entries it extends."""
        key = tuple(token_ids)
        for old in [k for k in self.entries if len(k) <= len(key) and key[: len(k)] == k]:
            del self.entries[old]
        self.entries[key] = cache
        while len(self.entries) > 1 and self.size_bytes() > self.capacity_bytes:
            self.entries.popitem(last=False)

    def size_bytes(self) -> int:
        return sum(len(k) for k in self.entries) * self.bytes_per_token

    def clear(self) -> None:
        self.entries.clear()
