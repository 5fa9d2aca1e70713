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
from ..logprobs import MAX_TOP

SCORED_TOP = MAX_TOP  # alternatives a scored block keeps: enough for any request's top_logprobs


def _scores_nbytes(scores: list) -> int:
    """About what a block's scores hold in memory (each entry a float and its (id, float) pairs)."""
    return sum(64 + 72 * len(e[1]) for e in scores if e is not None)


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
        self._scores: dict[bytes, list] = {}  # key -> (logprob, alternatives) of each of the block's tokens
        self.queries = self.hits = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def held(self, keys: list[bytes], scored: bool = False) -> int:
        """How many of `keys` (a prompt's chain keys), from the first, are kept (with scores, for
        `scored`); a look that neither counts as a query nor refreshes them."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks and (not scored or keys[n] in self._scores):
            n += 1
        return n

    def load(self, cache: KVCache, slot: int, ids: Sequence[int], limit: int, scored: bool = False) -> tuple[int, list]:
        """Copy the longest cached prefix of `ids`, at most `limit` positions, into `slot` (from
        position 0). Returns its length n (a multiple of the block size) and, with `scored`, the scores
        of its tokens 0 .. n-1 (the run then ends at the first block kept without them)."""
        self.queries += 1
        if not self.max_bytes:
            return 0, []
        found, scores = [], []
        for key in block_keys(ids, cache.block, limit // cache.block):
            data = self._blocks.get(key)
            if data is None or (scored and key not in self._scores):
                break
            self._blocks.move_to_end(key)
            found.append(data)
            if scored:
                scores += self._scores[key]
        n = len(found) * cache.block
        cache.grow(n)  # once, not block by block (write_block does not grow)
        for b, data in enumerate(found):
            cache.write_block(slot, b, data)
        if n:
            self.hits += 1
            self.hit_tokens += n
        return n, scores

    def store(self, cache: KVCache, slot: int, ids: Sequence[int], n_positions: int,
              scores: Sequence | None = None) -> None:
        """Remember the full blocks among the first `n_positions` positions of `slot`, which hold `ids`;
        `scores[i]`, where given, is (log p(ids[i]), its SCORED_TOP alternatives) (None for token 0)."""
        if not self.max_bytes:
            return
        B = cache.block
        for b, key in enumerate(block_keys(ids, B, n_positions // B)):
            part = list(scores[b * B:(b + 1) * B]) if scores is not None and len(scores) >= (b + 1) * B else None
            if key in self._blocks:
                self._blocks.move_to_end(key)
                if part is not None and key not in self._scores:
                    size = _scores_nbytes(part)
                    if not self._fit(size, keep=key):
                        return
                    self._scores[key] = part
                    self.nbytes += size
                continue
            data = cache.read_block(slot, b)
            size = sum(a.nbytes for a in data) + (_scores_nbytes(part) if part else 0)
            if not self._fit(size):
                return
            self._blocks[key] = data
            if part is not None:
                self._scores[key] = part
            self.nbytes += size

    def _fit(self, size: int, keep: bytes | None = None) -> bool:
        """Evict least recently used blocks (never `keep`) until `size` more bytes fit; False if they
        cannot."""
        if size > self.max_bytes:
            return False
        while self.nbytes + size > self.max_bytes:
            key = next(iter(self._blocks), None)
            if key is None or key == keep:
                return False
            old = self._blocks.pop(key)
            sc = self._scores.pop(key, None)
            self.nbytes -= sum(a.nbytes for a in old) + (_scores_nbytes(sc) if sc else 0)
            self.evictions += 1
        return True
