"""What a backend does, written down once. The CPU backend (`cpu/`) is one implementation; `Model`,
the engine and the tools use only this interface.

A backend instance is one loaded model on one device: it packs the checkpoint's weights for a dtype
(at load, releasing the file's pages as it copies), owns its thread count, makes KV caches, and runs
one forward pass over a batch of (sequence slot, tokens) items, each continuing its slot of a cache,
optionally with an op hook (tracing, fault injection). Every logits row must be the same bits whatever
else shares the pass, however a sequence's tokens were split over passes, and at any thread count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import ModelConfig
from ..errors import ContextLengthError, TinydetError
from ..rope import inv_freq
from .threads import check_threads

# hook(layer or None, op name, positions (n,), slots (n,), rows (n, width) float32): called after
# each op of the pass with its output rows, which it may change in place (the next op reads them).
Hook = Callable[[int | None, str, np.ndarray, np.ndarray, np.ndarray], None]
# The ops a hook sees, in the order a pass computes them (the post-norms only in models that have them).
# A mixture of experts' layer shows router (its logits, n_experts wide) and down (the experts' weighted
# sum) in place of gate, up, activation and down.
OPS = ("embedding", "attn_norm", "q", "k", "v", "rope_q", "rope_k", "attention", "attn_output",
       "post_attention_norm", "attn_residual", "ffn_norm", "gate", "up", "activation", "down", "post_ffn_norm",
       "ffn_residual", "final_norm", "logits", "router")  # router: a mixture of experts' logits
LOGITS = ("last", "all", "none")  # which logits rows an item wants


class KVCache(ABC):
    """Keys and values of `n_slots` sequences, up to `capacity` positions each; `lengths[slot]`
    counts the positions filled. The layout is the backend's."""

    lengths: np.ndarray  # (n_slots,) int64
    capacity: int

    @property
    def n_slots(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def length(self) -> int:
        """Positions filled in slot 0 (the whole cache when it holds one sequence)."""
        return int(self.lengths[0])

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence (old entries are overwritten before they are read)."""
        self.lengths[slot] = 0

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Hold at least `capacity` positions per slot, keeping every entry."""

    # Blocks: `block` consecutive positions of one slot, copied out and back in whole (the prefix
    # cache). A position's keys and values depend only on the tokens up to it, so a block copied into
    # another slot at the same positions is the same as computing it there.
    block: int

    @abstractmethod
    def read_block(self, slot: int, b: int) -> tuple[np.ndarray, ...]:
        """A copy of positions b*block .. (b+1)*block - 1 of `slot`."""

    @abstractmethod
    def write_block(self, slot: int, b: int, data: tuple[np.ndarray, ...]) -> None:
        """Put what `read_block` returned at block `b` of `slot`; the cache must already hold it (`grow`
        first), and the slot's length is the caller's to set."""

    @property
    @abstractmethod
    def nbytes(self) -> int: ...


@dataclass(frozen=True, eq=False)
class AttentionSetup:
    """What attention takes from a config, computed once per model and the same way for every device:
      inv_freq     each distinct RoPE's inverse frequencies (`rope.inv_freq`), the model's own first,
                   then the layers' as first seen
      rope_scale   YaRN's attention factor on that RoPE's cos and sin (float32; 1 for the others)
      layer_rope   (n_layers,) int64: each layer's RoPE, -1 for a NoPE layer (it rotates nothing)
      windows      (n_layers,) int64: the positions each layer attends to (0: all)
      scale        the factor on q.k, float32: the config's, else 1 / sqrt(head_dim)"""

    inv_freq: tuple[np.ndarray, ...]
    rope_scale: tuple[np.float32, ...]
    layer_rope: np.ndarray
    windows: np.ndarray
    scale: np.float32

    @classmethod
    def of(cls, cfg: ModelConfig) -> "AttentionSetup":
        ropes = list(dict.fromkeys((cfg.rope,) + cfg.layer_ropes))  # distinct RoPEs, first seen first
        layer_rope = [-1 if cfg.nope(i) else ropes.index(cfg.rope_of(i)) for i in range(cfg.n_layers)]
        windows = [cfg.window(i) for i in range(cfg.n_layers)]
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / np.sqrt(cfg.head_dim)
        return cls(tuple(inv_freq(r, cfg.head_dim) for r in ropes), tuple(np.float32(r.attention_factor) for r in ropes),
                   np.array(layer_rope, np.int64), np.array(windows, np.int64), np.float32(scale))

    def rope_rows(self, n: int, fill: Callable) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (RoPEs, n, head_dim / 2) float32 of positions 0 .. n-1: `fill(n, inv_freq, cos,
        sin)` writes one RoPE's (the CPU kernels' `ops.rope_tables`), then YaRN's attention factor
        scales them, one float32 product each. A row depends on its position alone, so a longer table
        keeps every row of a shorter one."""
        cos = np.empty((len(self.inv_freq), n, self.inv_freq[0].shape[0]), np.float32)
        sin = np.empty_like(cos)
        for r, f in enumerate(self.inv_freq):
            fill(n, f, cos[r], sin[r])
            if self.rope_scale[r] != 1:
                cos[r] *= self.rope_scale[r]
                sin[r] *= self.rope_scale[r]
        return cos, sin


@dataclass
class Batch:
    """A forward pass's items flattened: token ids, their positions and slots (T,), the rows whose
    logits are wanted, and each item's (first row, end row, logits wanted)."""

    ids: np.ndarray
    pos: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    spans: list[tuple[int, int, str]]


def plan_batch(items: Sequence[tuple], cache: KVCache, vocab_size: int, all_logits: bool) -> Batch:
    """Check a batch's items, `(slot, tokens)` or `(slot, tokens, logits)` with logits one of LOGITS
    (default "all" if `all_logits` else "last"), against the cache, and flatten them."""
    ids_l, pos_l, slot_l, spans, rows = [], [], [], [], []
    seen, t = set(), 0
    for item in items:
        slot, toks = item[0], np.asarray(item[1]).reshape(-1)
        # Integers only: casting to int64 would take 1.5 as token 1, and ids past int64 would overflow.
        if toks.shape[0] and toks.dtype.kind not in "iu":
            raise TinydetError(f"forward: token ids must be integers, found {toks.dtype} values")
        toks = toks.astype(np.int64, copy=False)
        want = item[2] if len(item) > 2 else ("all" if all_logits else "last")
        if want not in LOGITS:
            raise TinydetError(f"forward: logits must be one of {', '.join(LOGITS)}, found {want!r}")
        if toks.shape[0] == 0:
            raise TinydetError("forward: expected at least one token")
        if slot in seen or not 0 <= slot < cache.n_slots:
            raise TinydetError(f"forward: slot {slot} is repeated or outside 0..{cache.n_slots - 1}")
        seen.add(slot)
        start = int(cache.lengths[slot])
        n = toks.shape[0]
        if start + n > cache.capacity:
            raise ContextLengthError(f"{start + n} positions needed but the KV cache holds {cache.capacity}")
        ids_l.append(toks)
        pos_l.append(np.arange(start, start + n, dtype=np.int64))
        slot_l.append(np.full(n, slot, np.int64))
        if want == "all":
            rows.extend(range(t, t + n))
        elif want == "last":
            rows.append(t + n - 1)
        spans.append((t, t + n, want))
        t += n
    if not items:
        raise TinydetError("forward: expected at least one item")
    ids = ids_l[0] if len(ids_l) == 1 else np.concatenate(ids_l)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise TinydetError(f"token ids must lie in [0, {vocab_size}), found {int(ids.min())}..{int(ids.max())}")
    pos = pos_l[0] if len(pos_l) == 1 else np.concatenate(pos_l)
    slots = slot_l[0] if len(slot_l) == 1 else np.concatenate(slot_l)
    return Batch(ids, pos, slots, np.array(rows, np.int64), spans)


def split_logits(batch: Batch, logits: np.ndarray) -> list[np.ndarray | None]:
    """The logits rows of a pass, one array per item: (n, vocab) for "all", (1, vocab) for "last",
    None for "none"."""
    out, r = [], 0
    for a, b, want in batch.spans:
        n = b - a if want == "all" else (1 if want == "last" else 0)
        out.append(logits[r:r + n] if n else None)
        r += n
    return out


class Backend(ABC):
    """One loaded model on one device (module docstring).

    `hooks` is the documented seam for fault injection: op hooks that run on every forward pass of
    this instance, in order, before a hook passed to the call (so a trace records what a fault left).
    Tests use it to make a kernel's result wrong in a chosen way and check that `verify` or `diff`
    catches it; production code never sets it."""

    name: str
    config: ModelConfig
    dtype: str
    hooks: list  # of Hook

    def pass_hook(self, hook: Hook | None) -> Hook | None:
        """The one hook a pass runs: this instance's hooks, then the call's."""
        chain = list(self.hooks) + ([hook] if hook is not None else [])
        if len(chain) <= 1:
            return chain[0] if chain else None

        def run_all(layer, op, pos, slots, rows):
            for h in chain:
                h(layer, op, pos, slots, rows)
        return run_all

    @property
    def threads(self) -> int:
        """Host threads a forward pass uses (settable; None: the CPUs available); the bits never depend
        on it."""
        return self._threads

    @threads.setter
    def threads(self, n: int | None) -> None:
        self._threads = check_threads(n)

    @abstractmethod
    def new_cache(self, capacity: int, n_slots: int = 1) -> KVCache: ...

    @abstractmethod
    def forward_batch(self, items: Sequence[tuple], cache: KVCache, all_logits: bool = False,
                      hook: Hook | None = None) -> list[np.ndarray | None]:
        """One pass over `items` (see `plan_batch`), appending to their cache slots. Returns one logits
        array per item (float32), as `forward` would for it alone."""

    def forward(self, tokens: Sequence[int], cache: KVCache, all_logits: bool = False, slot: int = 0) -> np.ndarray:
        """Run `tokens` (ids at positions cache.lengths[slot]..) through the model, appending to the
        cache. Returns float32 logits: (len(tokens), vocab) if `all_logits`, else (1, vocab)."""
        return self.forward_batch([(slot, tokens)], cache, all_logits)[0]

    @abstractmethod
    def storage(self) -> dict[str, str]:
        """How each matrix kind is stored: "f32", "f16" or a GGML quant type name."""

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of weights held in memory."""

    def check_capacity(self, capacity: int) -> None:
        if capacity > self.config.context_length:
            raise ContextLengthError(
                f"{capacity} positions requested but the model's context length is {self.config.context_length}")
