"""The prefix cache: keys and values of token prefixes seen before, reused instead of recomputed.

The unit is a KV-cache block (`KVCache.block` positions, 64 on the CPU). Block b of a sequence is
named by a hash chain over its tokens: key_b = SHA-256(key_{b-1} + ids of block b), so a block is
found only under the very tokens that precede it, and its keys and values, which depend on nothing
else, are the bits the sequence would compute for itself. A lookup takes the longest run of cached
blocks from the start of a prompt; blocks are evicted least recently used beyond `max_bytes`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from ..backends import KVCache


def block_keys(ids: Sequence[int], block: int, n_blocks: int) -> list[bytes]:
    """The chain keys of the first `n_blocks` full blocks of `ids`."""
    keys, h = [], b""
    a = np.asarray(ids[:n_blocks * block], dtype="<i4")
    for b in range(n_blocks):
        h = hashlib.sha256(h + a[b * block:(b + 1) * block].tobytes()).digest()
        keys.append(h)
    return keys


class PrefixCache:
    """LRU over KV blocks, at most `max_bytes` of them (0: off)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, tuple[np.ndarray, ...]] = OrderedDict()
        self.queries = self.hits = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def load(self, cache: KVCache, slot: int, ids: Sequence[int], limit: int) -> int:
        """Copy the longest cached prefix of `ids`, at most `limit` positions, into `slot` (from
        position 0); returns its length (a multiple of the block size)."""
        self.queries += 1
        if not self.max_bytes:
            return 0
        found = []
        for key in block_keys(ids, cache.block, limit // cache.block):
            data = self._blocks.get(key)
            if data is None:
                break
            self._blocks.move_to_end(key)
            found.append(data)
        n = len(found) * cache.block
        cache.grow(n)  # once, not block by block (write_block does not grow)
        for b, data in enumerate(found):
            cache.write_block(slot, b, data)
        if n:
            self.hits += 1
            self.hit_tokens += n
        return n

    def store(self, cache: KVCache, slot: int, ids: Sequence[int], n_positions: int) -> None:
        """Remember the full blocks among the first `n_positions` positions of `slot`, which hold `ids`."""
        if not self.max_bytes:
            return
        for b, key in enumerate(block_keys(ids, cache.block, n_positions // cache.block)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            data = cache.read_block(slot, b)
            size = sum(a.nbytes for a in data)
            if size > self.max_bytes:
                return
            while self.nbytes + size > self.max_bytes:
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= sum(a.nbytes for a in old)
                self.evictions += 1
            self._blocks[key] = data
            self.nbytes += size
