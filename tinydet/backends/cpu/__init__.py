"""The CPU backend: numba kernels that keep the determinism contract (docs/determinism.md).

  qblocks.py  GGUF's quantized blocks read as float32 vectors
  loaders.py  how the matrix product reads each storage type: one dispatch by the storage's kind
  storage/    the kinds (float panels, native blocks, mixed, int8, int8-mixed), a module each, one table
  actq.py     activations to 8-bit blocks, for the integer mode (dtype "int8")
  intdot.py   the integer mode's block dot products (VNNI, AVX2, generic lowerings of one rule)
  tiles.py    rows times a panel's outputs, shared by every storage type; tile shapes per vector unit
  matmul.py   the one matrix product
  ops.py      RMSNorm, RoPE, attention, activations
  gqa.py      attention for the query heads of one KV group at once (AVX-512)
  forward.py  the one forward pass (an op hook traces it or injects faults)

The weights come packed from `packing/` (the layouts, their packers and the panel cache, shared with
the GPU backend); `storage/` is how these kernels take them.

The kernels build on `numerics/` (the vector layer, tinydet's own exp, log, sin, cos, tanh), imported
first: it points numba's cache at a directory keyed by these sources and its own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path
from typing import Sequence

import numba
import numpy as np

from ... import numerics  # noqa: F401  (first: numba's cache directory, before any kernel here is compiled)
from ...config import MOE_GATINGS, ModelConfig
from ...errors import TinydetError
from ...packing import panelcache
from ...packing.names import DTYPES
from ...packing.weights import CPUWeights
from ..base import AttentionSetup, Backend, Hook, KVCache, plan_batch, split_logits
from . import forward as _fw
from .ops import ACTIVATIONS, ATILE, rope_tables
from .storage.kinds import as_storage


def on_first_compile(callback) -> None:
    """Call `callback()` once, when numba first compiles a kernel in this process (a cache miss: the
    first run on a machine, or of a dtype or weight type not run before). Loads from the cache do
    not count, so a warm start stays silent."""
    from numba.core import event

    class _Once(event.Listener):
        fired = False

        def on_start(self, ev):
            if not self.fired:
                self.fired = True
                callback()

        def on_end(self, ev):
            pass

    event.register("numba:compile", _Once())


class CPUKVCache(KVCache):
    """Values by KV head, v (layer, slot, kv_head, capacity, head_dim); keys with 64 positions side by side,
    k (layer, slot, kv_head, ceil(capacity / 64), head_dim, 64), for attention's vectorized dot
    products. fp16 models cache binary16 bits (uint16), the others float32."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: str, n_slots: int = 1):
        self._cfg, self._st = cfg, np.uint16 if dtype == "fp16" else np.float32
        self.capacity = 0
        self.k = self.v = None
        self.lengths = np.zeros(n_slots, np.int64)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        cfg, L, S = self._cfg, self._cfg.n_layers, self.lengths.shape[0]
        k = np.zeros((L, S, cfg.n_kv_heads, -(-capacity // ATILE), cfg.head_dim, ATILE), self._st)
        v = np.zeros((L, S, cfg.n_kv_heads, capacity, cfg.head_dim), self._st)
        if self.k is not None:
            k[:, :, :, :self.k.shape[3]] = self.k
            v[:, :, :, :self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    block = ATILE  # one key tile

    def read_block(self, slot: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[:, slot, :, b].copy(), self.v[:, slot, :, b * ATILE:(b + 1) * ATILE].copy()

    def write_block(self, slot: int, b: int, data: tuple[np.ndarray, np.ndarray]) -> None:
        self.k[:, slot, :, b], self.v[:, slot, :, b * ATILE:(b + 1) * ATILE] = data


class CPUBackend(Backend):
    """A model packed for the CPU kernels. `CPUBackend(config, tensors, dtype, threads)` packs the
    checkpoint's tensors (canonical names, `formats.Tensor`s) for "fp32", "fp16", "native" or "int8";
    `source` (the model file) keeps the packed panels on disk (`panelcache`), `progress(done, total,
    name)` hears of each matrix kind packed."""

    name = "cpu-numba"

    def __init__(self, config: ModelConfig, tensors: dict, dtype: str = "fp32", threads: int | None = None,
                 source: Path | None = None, progress=None):
        if dtype not in DTYPES:
            raise TinydetError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
        self.config, self.dtype = config, dtype
        self.threads = threads
        self.hooks = []
        if source is None:
            self.weights = CPUWeights(config, tensors, dtype, progress)
        else:  # `source`: the model file, whose packed panels `panelcache` keeps
            self.weights = panelcache.load_or_pack(source, dtype, lambda: CPUWeights(config, tensors, dtype, progress),
                                                   CPUWeights.restore)
        w = self.weights
        self._w = (as_storage(w.table), w.attn_norm, as_storage(w.wqkv), w.bqkv, w.q_norm, w.k_norm,
                   as_storage(w.wo), w.bo, w.sinks, w.post_attn_norm, w.ffn_norm, as_storage(_kind(w, "w13", "w13e")),
                   as_storage(_kind(w, "w2", "w2e")), w.post_ffn_norm, w.norm, as_storage(w.output))
        # A mixture of experts' kinds, or None: the pass then compiles without the mixture's code.
        self._experts = None if config.dense_ffn else (as_storage(w.router), w.router_bias, as_storage(w.w13e),
                                                       w.b13e, as_storage(w.w2e), w.b2e)
        cfg = config
        self._att = AttentionSetup.of(cfg)
        self._cos = self._sin = np.zeros((len(self._att.inv_freq), 0, cfg.head_dim // 2), np.float32)
        self._rope_lock = threading.Lock()
        self._moe = (cfg.n_experts, cfg.n_experts_used, MOE_GATINGS.index(cfg.moe_gating), cfg.moe_norm_topk)
        f32 = np.float32
        self._scalars = (f32(cfg.rms_eps), self._att.scale, f32(cfg.embed_scale or 0.0), f32(cfg.logit_softcap or 0.0),
                         f32(cfg.attn_softcap or 0.0))

    def new_cache(self, capacity: int, n_slots: int = 1) -> CPUKVCache:
        self.check_capacity(capacity)
        return CPUKVCache(self.config, capacity, "fp16" if self.dtype == "fp16" else "fp32", n_slots)

    def _rope(self, n_pos: int):
        # Entries depend only on their own position, so growing the tables never changes old rows.
        with self._rope_lock:
            if self._cos.shape[1] < n_pos:
                n = max(n_pos, min(2 * self._cos.shape[1], self.config.context_length))
                self._cos, self._sin = self._att.rope_rows(n, rope_tables)
            return self._cos, self._sin

    def forward_batch(self, items: Sequence[tuple], cache: CPUKVCache, all_logits: bool = False,
                      hook: Hook | None = None) -> list[np.ndarray | None]:
        cfg, att = self.config, self._att
        b = plan_batch(items, cache, cfg.vocab_size, all_logits)
        cos, sin = self._rope(int(b.pos.max()) + 1)
        if numba.get_num_threads() != self._threads:  # numba's setting is per calling thread
            numba.set_num_threads(self._threads)
        hook_id = 0
        hook = self.pass_hook(hook)
        if hook is not None:
            hook_id = next(_hook_ids)
            _fw.HOOKS[hook_id] = hook
        try:
            with _LAUNCH if _serial() else contextlib.nullcontext():
                logits = _fw.forward(b.ids, b.pos, b.slots, b.rows, self._w, self._experts, cache.k, cache.v, cos,
                                     sin, att.layer_rope, att.windows, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                     cfg.ffn_dim, ACTIVATIONS[cfg.activation], self._moe, *self._scalars,
                                     cfg.vocab_size, self._threads, hook_id)
        finally:
            _fw.HOOKS.pop(hook_id, None)
        for item, (a, e, _) in zip(items, b.spans):
            cache.lengths[item[0]] += e - a
        return split_logits(b, logits)

    def storage(self) -> dict[str, str]:
        return self.weights.storage()

    def weight_bytes(self) -> int:
        return self.weights.nbytes()


def _kind(w: CPUWeights, name: str, other: str):
    """A matrix kind of the weights, or where the model has none (a mixture's dense FFN) another, of a
    type the pass compiles anyway, that it never reads."""
    return getattr(w, name) if hasattr(w, name) else getattr(w, other)


_hook_ids = itertools.count(1)
_LAUNCH = threading.Lock()


def _serial() -> bool:
    """numba's workqueue threading layer takes parallel launches from one thread at a time (omp and
    tbb take them from any number); until the first launch the layer is not known."""
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:
        return True
