"""Will a load fit? The memory it needs, estimated before anything is packed, against what is free.

A load that does not fit is refused with the numbers instead of being killed by the kernel's OOM
killer halfway through packing (or pushing the machine into swap). The estimate is the packed weights
at the chosen dtype plus the KV cache of one sequence of `KV_POSITIONS` positions (or the model's
context, if shorter): requests allocate their caches as they go, so this is the room a first ordinary
request needs, not a promise for every request a server may take.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import MemoryLimitError

KV_POSITIONS = 4096  # positions of KV cache the check reserves room for
_LANES = 64  # rows per packed panel (packing/layout.py LANES), and cache positions per key tile
ENV_OVERRIDE = "TINYDET_NO_MEMORY_CHECK"


def weight_bytes(tensors: dict, dtype: str) -> int:
    """Bytes the CPU backend's packed weights take for `tensors` (a Checkpoint's, canonical names) at
    `dtype`: float32 for vectors; matrices at 4 bytes a weight (fp32), 2 (fp16), or in native storage
    the file's own bytes for a type the kernels read as stored (quantized blocks, F16), else 4. A
    layer's fused matrices ([wq; wk; wv], [w1; w3]; a mixture's router and each expert's) and the output
    round their rows up to whole 64-row panels, as the backend packs them. A tied output (the embedding's object) counts once."""
    from .packing.names import MATRICES, NATIVE_TYPES
    from .formats.ggml import F16, row_bytes

    def nbytes(t, rows: int) -> int:  # t's bytes, its row count taken as `rows`
        if dtype in ("native", "int8") and (t.ggml_type in NATIVE_TYPES or t.ggml_type == F16):
            return row_bytes(t.ggml_type, t.shape[-1]) * rows  # not t.data: a derived tensor would compute it
        return rows * (math.prod(t.shape) // t.shape[0]) * (2 if dtype == "fp16" else 4)

    def panels(n: int) -> int:
        return -(-n // _LANES) * _LANES

    total, seen = 0, set()
    # each packed matrix's parts: a layer's kinds, a mixture's router and each expert's [w1; w3] and w2
    packed = [[f"layers.{i}.{p}" for p in parts] for i in range(_n_layers(tensors)) for _, parts in MATRICES]
    packed += [[f"layers.{i}.router"] for i in range(_n_layers(tensors))]
    e = 0
    while f"layers.0.experts.{e}.w1" in tensors:
        packed += [[f"layers.{i}.experts.{e}.{p}" for p in parts] for i in range(_n_layers(tensors))
                   for parts in (("w1", "w3"), ("w2",))]
        e += 1
    fused = {name for names in packed for name in names}
    for names in packed:
        ts = [tensors[n] for n in names if n in tensors]
        if ts:  # padding rows cost what a row of the first part costs
            total += sum(nbytes(t, t.shape[0]) for t in ts)
            total += nbytes(ts[0], panels(sum(t.shape[0] for t in ts)) - sum(t.shape[0] for t in ts))
    for name, t in tensors.items():
        if name in fused or id(t) in seen:
            continue
        seen.add(id(t))
        if t.ndim < 2:
            total += 4 * math.prod(t.shape)
        else:  # output panels; the embedding table, when not tied, is kept unpadded
            total += nbytes(t, panels(t.shape[0]) if name == "output" or t is tensors.get("output") else t.shape[0])
    return total


def _n_layers(tensors: dict) -> int:
    n = 0
    while f"layers.{n}.wq" in tensors:
        n += 1
    return n


def kv_bytes(cfg, dtype: str, positions: int) -> int:
    """Bytes of a one-sequence KV cache of `positions` (backends/cpu CPUKVCache: keys in 64-position
    tiles, values by position; binary16 for fp16 models, else float32)."""
    item = 2 if dtype == "fp16" else 4
    tiles = -(-positions // _LANES) * _LANES
    return cfg.n_layers * cfg.kv_dim * (tiles + positions) * item


def available_bytes() -> int | None:
    """Memory this process can still get: MemAvailable from /proc/meminfo (Linux: free memory plus
    what the kernel can reclaim), lowered to a cgroup v2 limit's headroom inside a container, else
    the free physical pages `os.sysconf` reports; None where neither can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None
    try:  # a container's own limit is what gets it killed, whatever the host has free
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return avail


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_memory(path, cfg, tensors: dict, dtype: str) -> int:
    """Raise MemoryLimitError when loading `tensors` at `dtype` (+ KV cache) needs more than
    `available_bytes()`; returns the estimate. Where that figure cannot be read, nothing is refused."""
    need_w = weight_bytes(tensors, dtype)
    positions = min(cfg.context_length, KV_POSITIONS)
    need = need_w + kv_bytes(cfg, dtype, positions)
    avail = available_bytes()
    if avail is not None and need > avail:
        raise MemoryLimitError(
            f"{path}: memory: loading at dtype {dtype} needs about {_gib(need)} ({_gib(need_w)} of weights + "
            f"{_gib(need - need_w)} of KV cache for {positions} positions) but only {_gib(avail)} is available; "
            f"try --dtype native or fp16, or override with check_memory=False / --no-memory-check / "
            f"{ENV_OVERRIDE}=1")
    return need
