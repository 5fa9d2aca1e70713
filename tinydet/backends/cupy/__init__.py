"""The GPU backend: the CPU backend's forward pass as CUDA kernels (kernels.cu), run through CuPy on an
NVIDIA GPU (`device.CudaDevice`) or, on a machine without one, by a serial emulator built from the
same source (`device.HostDevice`; the tests use it).

Every output is computed in the CPU backend's order, each chain of operations in one thread (64-long
k-blocks of plain float32 sums, each a chain of its own, added in order with Kahan compensation;
per-element Kahan in RMSNorm and attention; tinydet's own exp and tanh), so each logits row has the
CPU's bits: the same golden hashes, any batch, any chunking. Around those chains the kernels are a
GPU's: the products tiled through shared memory (gemm) or reading each weight once for a few rows
(gemv), attention a thread block per row and head, and without a hook the small steps fused into
their neighbours (`CudaBackend._pass`). The weights are the CPU backend's packed weights
(`packing.weights.CPUWeights`: the same panels, quantized blocks dequantized inside the kernels), copied to
the device; in dtype "int8" the integer kinds' products are the CPU's integer block dots (`intproducts`:
activations quantized per block, `__dp4a`, each output the Kahan sum of its blocks' terms in order).
Decode steps (one token per item, no hook) on a GPU replay a CUDA graph captured on the first step of
each shape.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Sequence

import numpy as np

from ...config import ModelConfig
from ...errors import MemoryLimitError, TinydetError
from ..base import OPS, AttentionSetup, Backend, Hook, KVCache, plan_batch, split_logits
from ..cpu.ops import GELU_B, GELU_K, ACTIVATIONS, ATILE, rope_tables
from ...packing.names import DTYPES, MATRICES
from ...packing.weights import CPUWeights
from .device import CudaDevice, HostDevice
from .intproducts import ActBuffers
from .products import AMAX_HD, BLOCK, Matrix, blocks, embed, embed_rows, mm, product, rms_inv_rows

__all__ = ["CudaBackend", "CudaDevice", "HostDevice", "embed", "product"]

(EMBEDDING, ATTN_NORM, Q, K, V, ROPE_Q, ROPE_K, ATTENTION, ATTN_OUTPUT, POST_ATTN_NORM, ATTN_RESIDUAL, FFN_NORM, GATE,
 UP, ACTIVATION, DOWN, POST_FFN_NORM, FFN_RESIDUAL, FINAL_NORM, LOGITS, _ROUTER) = OPS

@contextlib.contextmanager
def _fits(dev, what: str):
    """CuPy's OutOfMemoryError as a MemoryLimitError that says what did not fit."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "OutOfMemoryError":
            raise
        raise MemoryLimitError(f"device {dev.name}: {what} do not fit in the GPU's free memory ({e})") from None


class CudaKVCache(KVCache):
    """The CPU backend's cache layout on the device: keys k (layer, slot, kv_head, ceil(capacity / 64),
    head_dim, 64), values v (layer, slot, capacity, kv_dim); fp16 models cache binary16 bits."""

    block = ATILE

    def __init__(self, dev, cfg: ModelConfig, capacity: int, half: bool, n_slots: int = 1):
        self._dev, self._cfg, self._st = dev, cfg, np.uint16 if half else np.float32
        self.capacity = 0
        self.k = self.v = None
        self.lengths = np.zeros(n_slots, np.int64)
        self.graphs = {}  # decode graphs captured on this cache's arrays (CudaBackend._decode)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        cfg, xp, S = self._cfg, self._dev.xp, self.lengths.shape[0]
        with self._dev.context(), _fits(self._dev, f"the keys and values of {S} x {capacity} positions"):
            k = xp.zeros((cfg.n_layers, S, cfg.n_kv_heads, -(-capacity // ATILE), cfg.head_dim, ATILE), self._st)
            v = xp.zeros((cfg.n_layers, S, capacity, cfg.kv_dim), self._st)
            if self.k is not None:
                k[:, :, :, :self.k.shape[3]] = self.k
                v[:, :, :self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity
        self.graphs = {}  # they point at the old arrays

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def read_block(self, slot: int, b: int) -> tuple:
        with self._dev.context():
            return self.k[:, slot, :, b].copy(), self.v[:, slot, b * ATILE:(b + 1) * ATILE].copy()

    def write_block(self, slot: int, b: int, data: tuple) -> None:
        with self._dev.context():
            self.k[:, slot, :, b], self.v[:, slot, b * ATILE:(b + 1) * ATILE] = data


class _Workspace:
    """The device buffers of one pass shape: T tokens, R logits rows."""

    def __init__(self, xp, cfg: ModelConfig, T: int, R: int, int8: bool = False):
        f32, i64 = np.float32, np.int64
        dim = cfg.dim
        self.T, self.R = T, R
        self.ids, self.pos, self.slots = (xp.zeros(T, i64) for _ in range(3))
        self.rows = xp.zeros(max(R, 1), i64)
        self.x, self.h, self.proj = (xp.empty((T, dim), f32) for _ in range(3))
        self.qkv = xp.empty((T, cfg.q_dim + 2 * cfg.kv_dim), f32)
        self.q, self.att = (xp.empty((T, cfg.q_dim), f32) for _ in range(2))
        self.gu = xp.empty((T, 2 * cfg.ffn_dim), f32)
        self.a = xp.empty((T, cfg.ffn_dim), f32)
        self.xr = xp.empty((max(R, 1), dim), f32)
        self.logits = xp.empty((max(R, 1), cfg.vocab_size), f32)
        self.inv = xp.empty(max(T, R, 1), f32)  # RMSNorm's 1 / rms per row
        # the int8 mode's quantized activations (intproducts.ActBuffers): any product's input fits
        self.act = ActBuffers(xp, max(T, R, 1), max(dim, cfg.q_dim, cfg.ffn_dim)) if int8 else None


class CudaBackend(Backend):
    """A model packed for the GPU kernels: `CudaBackend(config, tensors, dtype, threads, device)` packs
    the checkpoint as the CPU backend does ("fp32", "fp16", "native" or "int8") and copies it to
    `device` (a `CudaDevice`, the default, or a `HostDevice`). `threads` is kept for the interface
    (host threads play no part in the GPU's arithmetic)."""

    def __init__(self, config: ModelConfig, tensors: dict, dtype: str = "fp32", threads: int | None = None,
                 device=None):
        if dtype not in DTYPES:
            raise TinydetError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
        if not config.dense_ffn:
            raise TinydetError(f"{config.arch}: mixtures of experts run on the CPU backend only, for now")
        # Flags kernels.cu does not implement: refused, never run as some other model.
        if any(config.layer_nope):
            raise TinydetError(f"{config.arch}: NoPE layers (layer_nope) run on the CPU backend only, for now")
        if config.attn_sinks or config.attn_out_bias:
            raise TinydetError(f"{config.arch}: attention sinks and an output projection bias run on the CPU backend "
                               "only, for now")
        if config.head_dim > AMAX_HD:
            raise TinydetError(f"{config.arch}: head_dim {config.head_dim} is larger than the GPU kernels' {AMAX_HD}; "
                               "such models run on the CPU backend only, for now")
        if config.attn_softcap:
            raise TinydetError(f"{config.arch}: attention logit soft-capping (attn_softcap) runs on the CPU backend "
                               "only, for now")
        self.dev = device if device is not None else CudaDevice()
        self.name = f"cuda-{self.dev.name}" if isinstance(self.dev, HostDevice) else self.dev.name
        self.config, self.dtype = config, dtype
        self.threads = threads
        self.hooks = []
        self._lock = threading.Lock()  # one pass at a time: the device's stream and the decode workspaces
        w = CPUWeights(config, tensors, dtype)
        self._storage, self._nbytes = w.storage(), w.nbytes()
        dev, cfg = self.dev, config
        n_out = {"wqkv": cfg.q_dim + 2 * cfg.kv_dim, "wo": cfg.dim, "w13": 2 * cfg.ffn_dim, "w2": cfg.dim}
        with dev.context(), _fits(dev, f"the weights ({self._nbytes / 2**20:.0f} MiB at {dtype})"):
            self._dummy = dev.to_device(np.zeros(1, np.float32))
            self._mats = {name: Matrix(dev, getattr(w, name), n_out[name], True, self._dummy) for name, _ in MATRICES}
            self._output = Matrix(dev, w.output, cfg.vocab_size, False, self._dummy)
            self._table = self._output if w.table is w.output else Matrix(dev, w.table, cfg.vocab_size, False,
                                                                            self._dummy)
            self._vec = {name: dev.to_device(getattr(w, name)) for name in (
                "attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "bqkv", "norm")}
        del w
        self._att = AttentionSetup.of(cfg)
        self._rope_n = 0
        self._cos = self._sin = None
        self._eps = np.float32(cfg.rms_eps)
        self._act = ACTIVATIONS[cfg.activation]
        self.graphs = hasattr(dev, "stream") and os.environ.get("TINYDET_CUDA_GRAPHS", "1") != "0"

    def new_cache(self, capacity: int, n_slots: int = 1) -> CudaKVCache:
        self.check_capacity(capacity)
        return CudaKVCache(self.dev, self.config, capacity, self.dtype == "fp16", n_slots)

    def storage(self) -> dict[str, str]:
        return dict(self._storage)

    def weight_bytes(self) -> int:
        return self._nbytes

    # -----------------------------------------------------------------------------------------------

    def _rope(self, n_pos: int) -> None:
        """cos/sin tables (one per distinct RoPE) of at least n_pos positions on the device: the CPU
        backend's (`AttentionSetup.rope_rows`, YaRN's factor included), computed on the host. Rows depend
        only on their position."""
        if self._rope_n >= n_pos:
            return
        n = max(n_pos, min(2 * self._rope_n, self.config.context_length))
        cos, sin = self._att.rope_rows(n, rope_tables)
        self._cos, self._sin = [self.dev.to_device(c) for c in cos], [self.dev.to_device(s) for s in sin]
        self._rope_n = n

    def forward_batch(self, items: Sequence[tuple], cache: CudaKVCache, all_logits: bool = False,
                      hook: Hook | None = None) -> list[np.ndarray | None]:
        cfg = self.config
        b = plan_batch(items, cache, cfg.vocab_size, all_logits)
        hook = self.pass_hook(hook)
        T, R = b.ids.shape[0], b.rows.shape[0]
        decode = hook is None and T == len(b.spans)  # one token per item
        with self._lock, self.dev.context():
            self._rope(cache.capacity if decode else int(b.pos.max()) + 1)
            if decode:
                # Decode workspaces stay from step to step, so that a captured graph can replay them.
                ws = cache.graphs.get((T, R))
                if ws is None or ws.rope_n != self._rope_n:  # new shape, or the RoPE tables moved
                    with _fits(self.dev, f"the buffers of a pass of {T} tokens"):
                        ws = cache.graphs[(T, R)] = _Workspace(self.dev.xp, cfg, T, R, self.dtype == "int8")
                    ws.graph, ws.rope_n = None, self._rope_n
                self._inputs(ws, b)
                if self.graphs and ws.graph is None:
                    ws.graph = self._capture(ws, cache)
                if ws.graph is not None:
                    ws.graph.launch(self.dev.stream)
                else:
                    self._pass(ws, cache, None, b)
            else:
                with _fits(self.dev, f"the buffers of a pass of {T} tokens"):
                    ws = _Workspace(self.dev.xp, cfg, T, R, self.dtype == "int8")
                self._inputs(ws, b)
                self._pass(ws, cache, hook, b)
            logits = self.dev.to_host(ws.logits[:R]) if R else np.zeros((0, cfg.vocab_size), np.float32)
        for item, (a, e, _) in zip(items, b.spans):
            cache.lengths[item[0]] += e - a
        return split_logits(b, np.array(logits, np.float32, copy=True))

    def _inputs(self, ws: _Workspace, b) -> None:
        for dst, host in ((ws.ids, b.ids), (ws.pos, b.pos), (ws.slots, b.slots), (ws.rows[:b.rows.shape[0]], b.rows)):
            if host.shape[0]:
                self.dev.put(dst, host)

    def _capture(self, ws: _Workspace, cache: CudaKVCache):
        """The decode pass on `ws` as a CUDA graph, or None (graphs then off, with a warning) if CuPy or
        the driver refuses the capture: the same kernels run either way."""
        stream = self.dev.stream
        try:
            stream.begin_capture()
            try:
                self._pass(ws, cache, None, None)
            finally:
                graph = stream.end_capture()
        except Exception as e:
            warnings.warn(f"tinydet: CUDA graph capture failed ({e}); decoding without graphs", RuntimeWarning)
            self.graphs = False
            return None
        return graph

    # -----------------------------------------------------------------------------------------------
    # The pass: forward.py's operations with the same hook points. Without a hook, steps that keep
    # their arithmetic are fused: RMSNorm into the next product's loads, the qkv bias and the residual
    # adds into the products' epilogues, a post-norm with its residual add; with one, every op is its
    # own kernel so that the hook sees (and may change) each op's output.

    def _mm(self, ws: _Workspace, x, mat: Matrix, li, out, norm=None, bias=None, epi: int = 0) -> None:
        """`_mm` of layer li's matrix; norm: RMSNorm's weights (the product of RMSNorm(x))."""
        mm(self.dev, x, mat.layer(li), out, self._dummy, None if norm is None else (norm, self._eps), ws.inv,
           bias, epi, ws.act)

    def _rmsnorm(self, ws: _Workspace, x, w, out) -> None:
        T, D = x.shape
        rms_inv_rows(self.dev, x, self._eps, ws.inv)
        self.dev.launch("rms_scale", (blocks(T * D),), (BLOCK,), (x, T, D, ws.inv, w, out))

    def _see(self, hook, li, op, pos, slots, a, c0=0, c1=None) -> None:
        """The op hook on columns c0..c1 of `a`: given a host copy, whose changes are copied back."""
        if hook is None:
            return
        c1 = a.shape[1] if c1 is None else c1
        rows = np.array(self.dev.to_host(a[:, c0:c1]), np.float32, copy=True)
        hook(li, op, pos, slots, rows)
        a[:, c0:c1] = self.dev.to_device(rows)

    def _normed_mm(self, ws, hook, li, op, pos, slots, x, norm, mat, out, bias=None) -> None:
        """out = RMSNorm(x) W[li]^T (+ bias): one product without a hook, else RMSNorm to ws.h (the hook's
        op), the product and the bias each on their own."""
        if hook is None:
            self._mm(ws, x, mat, li, out, norm, bias, int(bias is not None))
            return
        h = ws.h[:x.shape[0]]
        self._rmsnorm(ws, x, norm, h)
        self._see(hook, li, op, pos, slots, h)
        self._mm(ws, h, mat, li, out)
        if bias is not None:
            n = out.shape[1]
            self.dev.launch("add_bias", (blocks(out.shape[0] * n),), (BLOCK,), (out, bias, out.shape[0], n))

    def _pass(self, ws: _Workspace, cache: CudaKVCache, hook, b) -> None:
        cfg, dev, v = self.config, self.dev, self._vec
        T, R, H, hd = ws.T, ws.R, cfg.n_heads, cfg.head_dim
        q_dim, kv_dim, dim, F = cfg.q_dim, cfg.kv_dim, cfg.dim, cfg.ffn_dim
        pos, slots = (b.pos, b.slots) if b is not None else (None, None)
        half = int(self.dtype == "fp16")
        tiles = cache.k.shape[3]
        x, qkv = ws.x, ws.qkv
        embed_rows(dev, ws.ids, T, dim, self._table.layer(None), x)
        if cfg.embed_scale:
            dev.launch("scale_rows", (blocks(T * dim),), (BLOCK,), (x, np.float32(cfg.embed_scale), T * dim))
        self._see(hook, None, EMBEDDING, pos, slots, x)
        for li in range(cfg.n_layers):
            kc, vc = cache.k[li], cache.v[li]
            self._normed_mm(ws, hook, li, ATTN_NORM, pos, slots, x, v["attn_norm"][li], self._mats["wqkv"], qkv,
                            v["bqkv"][li] if v["bqkv"].shape[1] else None)
            self._see(hook, li, Q, pos, slots, qkv, 0, q_dim)
            self._see(hook, li, K, pos, slots, qkv, q_dim, q_dim + kv_dim)
            self._see(hook, li, V, pos, slots, qkv, q_dim + kv_dim, q_dim + 2 * kv_dim)
            r = self._att.layer_rope[li]
            qn, kn = v["q_norm"], v["k_norm"]
            dev.launch("rope_store", (blocks(T * (H + cfg.n_kv_heads)),), (BLOCK,),
                       (qkv, T, q_dim, kv_dim, hd, self._cos[r], self._sin[r], ws.pos, ws.slots, kc, vc, half, tiles,
                        cache.capacity, ws.q, qn[li] if qn.shape[1] else self._dummy, int(qn.shape[1] > 0),
                        kn[li] if kn.shape[1] else self._dummy, int(kn.shape[1] > 0), self._eps))
            self._see(hook, li, ROPE_Q, pos, slots, ws.q)
            if hook is not None:  # what the cache holds
                keys = dev.to_host(kc[ws.slots, :, ws.pos // ATILE, :, ws.pos % ATILE])
                keys = keys.view(np.float16).astype(np.float32) if half else np.array(keys, np.float32)
                hook(li, ROPE_K, pos, slots, np.ascontiguousarray(keys.reshape(T, kv_dim)))
            self._attention(ws, kc, vc, half, tiles, cache.capacity, self._att.windows[li])
            self._see(hook, li, ATTENTION, pos, slots, ws.att)
            self._project(ws.att, "wo", li, v["post_attn_norm"], hook, (ATTN_OUTPUT, POST_ATTN_NORM, ATTN_RESIDUAL),
                          ws, pos, slots)
            self._normed_mm(ws, hook, li, FFN_NORM, pos, slots, x, v["ffn_norm"][li], self._mats["w13"], ws.gu)
            self._see(hook, li, GATE, pos, slots, ws.gu, 0, F)
            self._see(hook, li, UP, pos, slots, ws.gu, F, 2 * F)
            dev.launch("glu", (blocks(T * F),), (BLOCK,), (ws.gu, T, F, self._act, GELU_B, GELU_K, ws.a))
            self._see(hook, li, ACTIVATION, pos, slots, ws.a)
            self._project(ws.a, "w2", li, v["post_ffn_norm"], hook, (DOWN, POST_FFN_NORM, FFN_RESIDUAL), ws, pos, slots)
        if R == 0:
            return
        dev.launch("gather_rows", (blocks(R * dim),), (BLOCK,), (x, dim, ws.rows, R, ws.xr))
        pr, sr = (b.pos[b.rows], b.slots[b.rows]) if b is not None else (None, None)
        logits = ws.logits[:R]
        self._normed_mm(ws, hook, None, FINAL_NORM, pr, sr, ws.xr[:R], v["norm"], self._output, logits)
        if cfg.logit_softcap:
            dev.launch("softcap", (blocks(R * cfg.vocab_size),), (BLOCK,),
                       (logits, R * cfg.vocab_size, np.float32(cfg.logit_softcap)))
        self._see(hook, None, LOGITS, pr, sr, logits)

    def _project(self, a, kind, li, post, hook, ops, ws, pos, slots) -> None:
        """x += a W[li]^T, through a post-norm of the product where the model has one: without a hook,
        the residual add is the product's epilogue (or the post-norm's step)."""
        op, post_op, res_op = ops
        n = ws.x.size
        if hook is None and not post.shape[1]:
            self._mm(ws, a, self._mats[kind], li, ws.x, epi=2)
            return
        self._mm(ws, a, self._mats[kind], li, ws.proj)
        self._see(hook, li, op, pos, slots, ws.proj)
        if post.shape[1]:
            if hook is None:
                T, D = ws.proj.shape
                rms_inv_rows(self.dev, ws.proj, self._eps, ws.inv)
                self.dev.launch("rms_scale_add", (blocks(n),), (BLOCK,), (ws.x, ws.proj, T, D, ws.inv, post[li]))
                return
            self._rmsnorm(ws, ws.proj, post[li], ws.proj)
            self._see(hook, li, post_op, pos, slots, ws.proj)
        self.dev.launch("add_rows", (blocks(n),), (BLOCK,), (ws.x, ws.proj, n))
        self._see(hook, li, res_op, pos, slots, ws.x)

    def _attention(self, ws: _Workspace, kc, vc, half, tiles, cap, window) -> None:
        cfg = self.config
        T, H, hd = ws.T, cfg.n_heads, cfg.head_dim
        threads = max(BLOCK, -(-(hd + 1) // 32) * 32)  # a thread per d and one for the denominator
        self.dev.launch("attend", (T * H,), (threads,),
                        (ws.q, T, H, cfg.n_kv_heads, hd, kc, vc, half, tiles, cap, ws.pos, ws.slots, self._att.scale,
                         window, ws.att))
