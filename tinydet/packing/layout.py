"""The weight layouts both backends read: float panels and quantized panels. Layout only: packing moves
bytes and never rounds anything (fp16's one rounding is `simd.to_f16_bits`, at load).

Float panels: W[N, K] -> Wp[ceil(N/64), K, 64], rows past N zero: the inner loop of the matrix
product runs over 64 independent outputs.

Quantized panels, for GGUF's block-quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4), read
by the CPU's `loaders.py` and the GPU's kernels: the fp32 path dequantizes W[N, K] and packs it as
float panels; the native path keeps GGUF's blocks and rearranges them the same way, L = 32 rows
(outputs, `QPANEL`) side by side, so that the kernel's inner loop runs over L contiguous lanes just as
it does for floats. With P = ceil(N / 32) panels, nb = K/32 blocks of 32 elements and ns = K/256
super-blocks (K-quants) per row:

  qs  Q8_0    int8   (P, K, 32)       qs[p, k, j] = quant k of row 32p+j                    1 B/weight
      others  uint32 (P, nb, 4, 32)   qs[p, b, g, j] = the low 4 bits of elements 32b+8g .. 32b+8g+7
                                      of row 32p+j, element 32b+8g+i in bits 4i..4i+3       0.5 B/weight
  qh  Q5_0,   uint32 (P, nb, 32)      bit e: the 5th bit of element 32b+e of row 32p+j
      Q5_1,
      Q5_K
      Q6_K    uint32 (P, nb, 2, 32)   qh[p, b, h, j] bits 2i, 2i+1: the high 2 bits of element 32b+16h+i
  sc  Q4_K,   uint8  (P, ns, 12, 32)  the 12 bytes of 6-bit sub-block scales and mins, as stored
      Q5_K
      Q6_K    int8   (P, ns, 16, 32)  the 16 int8 scales (one per 16 elements), as stored
  d   all     uint16 (P, nb, 32)      fp16 bits of the scale d of block b of row 32p+j (K-quants:
                                      (P, ns, 32), super-block s's d)
      MXFP4   uint8  (P, nb, 32)      the E8M0 exponent byte e of block b of row 32p+j, as stored
  m   Q4_1,   uint16 (P, nb, 32)      fp16 bits of its min m
      Q5_1
      Q4_K,   uint16 (P, ns, 32)      fp16 bits of super-block s's dmin
      Q5_K

i.e. exactly GGUF's bytes per weight (34/32, 18/32, 20/32, 22/32, 24/32, 144/256, 176/256, 210/256, MXFP4's
17/32; its nibbles are E2M1 codes, not integers, `backends/cpu/qblocks.py`). The
4-bit quants are regrouped from ggml's byte order (Q4_x/Q5_0/MXFP4 byte i: element i in the low nibble,
element 16+i in the high one; Q4_K/Q5_K: sub-block 2c the low and 2c+1 the high nibbles of bytes
32c..32c+31; Q6_K's own interleaving, `formats.dequant`) into 32-bit words of 8 consecutive elements,
so that one shift (and a mask or a table lookup) gives L lanes' quants for one k: decode is
compute-bound, and this costs fewer instructions than unpacking bytes (about 8% faster). The high bits
are regrouped the same way (Q5_K's from bit i of its bytes 0..31 for sub-block i), the 6-bit scales
and int8 scales are the stored bytes, moved.

Rows past N (the last panel's padding) are zero bytes: weight 0, computed and never stored. The kernels
widen fp16 scales exactly (F16C where the compile target has it, else an integer conversion);
`formats.dequant` uses NumPy's float16 -> float32 cast. They agree on every pattern but the signaling
NaNs, which F16C quiets and the others keep. The packer stores those quieted (`repack.quiet_snans`):
every widening then gives the one quiet NaN that NumPy's dequantization gives each weight such a scale
multiplies (arithmetic quiets a NaN and keeps its payload), and scales stay fp16 bits, one dtype.

Rows move whole, so Q/K un-permutation and concatenation ([wq; wk; wv], [w1; w3]) happen on the raw
block rows: `pack_parts([(raw_q, order_q), (raw_k, order_k), (raw_v, None)], type, dim)` is the matrix
the fp32 path builds by concatenating the dequantized rows in those orders. A matrix kind whose layers
or runs of rows have different types is a `MixedPanels` (below): each run kept in its own type.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ..formats.ggml import GGML_TYPE_IDS, GGML_TYPES, MXFP4, Q4_0, Q4_1, Q8_0
from ..numerics.simd import HALF as QPANEL  # rows per quantized panel: the kernels' 32-lane vectors
from . import repack
from ..numerics.simd import LANES
from .names import NATIVE_TYPES

QBLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 / Q5_0 block, and per K-quant sub-block
QK_K = 256  # elements per K-quant super-block
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (GGML_TYPE_IDS[t] for t in ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
K_QUANTS = (Q4_K, Q5_K, Q6_K)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(n + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n].view(dtype).reshape(shape)


def pack_panels(w: np.ndarray) -> np.ndarray:
    """W[N, K] -> Wp[ceil(N/64), K, 64], rows past N zero. Layout only: no arithmetic."""
    n, k = w.shape
    p = -(-n // LANES)
    padded = np.zeros((p * LANES, k), w.dtype)
    padded[:n] = w
    out = aligned_empty((p, k, LANES), w.dtype)
    out[...] = padded.reshape(p, LANES, k).transpose(0, 2, 1)
    return out


def _shapes(t: int, P: int, k: int) -> dict:
    """The (dtype, shape) of each array of a type's quantized panels (None: absent), per the module
    docstring."""
    nb, ns = k // QBLOCK, k // QK_K
    scale = (np.uint16, (P, ns if t in K_QUANTS else nb, QPANEL))
    return {"qs": (np.int8, (P, k, QPANEL)) if t == Q8_0 else (np.uint32, (P, nb, 4, QPANEL)),
            "d": (np.uint8, (P, nb, QPANEL)) if t == MXFP4 else scale,
            "m": scale if t in (Q4_1, Q5_1, Q4_K, Q5_K) else None,
            "sc": {Q4_K: (np.uint8, (P, ns, 12, QPANEL)), Q5_K: (np.uint8, (P, ns, 12, QPANEL)),
                   Q6_K: (np.int8, (P, ns, 16, QPANEL))}.get(t),
            "qh": {Q5_0: (np.uint32, (P, nb, QPANEL)), Q5_1: (np.uint32, (P, nb, QPANEL)),
                   Q5_K: (np.uint32, (P, nb, QPANEL)),
                   Q6_K: (np.uint32, (P, nb, 2, QPANEL))}.get(t)}


@dataclass(frozen=True)
class QPanels:
    """A quantized matrix W[n, k] in panel layout (see the module docstring)."""

    ggml_type: int  # a key of NATIVE_TYPES
    n: int  # rows (outputs)
    k: int  # row length (inputs), a multiple of 32 (of 256 for K-quants)
    qs: np.ndarray  # Q8_0: int8 (P, k, 32); the others: uint32 (P, k/32, 4, 32)
    d: np.ndarray  # (P, k/32, 32) (K-quants: (P, k/256, 32)) uint16 fp16 bits; MXFP4: uint8 E8M0
    m: np.ndarray | None = None  # Q4_1's mins, Q4_K/Q5_K's dmin: like d; otherwise None
    sc: np.ndarray | None = None  # K-quants' sub-block scales (and mins); otherwise None
    qh: np.ndarray | None = None  # Q5_0/Q5_K's 5th bits, Q6_K's high 2 bits; otherwise None

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.ggml_type]

    @property
    def n_panels(self) -> int:
        return self.qs.shape[0]

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.qs, self.d, self.m, self.sc, self.qh) if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the matrix reads (padding included)."""
        return sum(a.nbytes for a in self.arrays())

    def check(self) -> None:
        """Raise unless the arrays have this module's layout (the kernels read raw pointers)."""
        t = self.ggml_type
        if t not in NATIVE_TYPES:
            raise ValueError(f"QPanels: unsupported ggml type {t}")
        P = self.qs.shape[0] if isinstance(self.qs, np.ndarray) and self.qs.ndim else 0
        block = QK_K if t in K_QUANTS else QBLOCK
        ok = self.k > 0 and self.k % block == 0 and P * QPANEL >= self.n
        for name, want in _shapes(t, P, self.k).items() if ok else ():
            a = getattr(self, name)
            if want is None:
                ok = ok and a is None
                continue
            ok = ok and (isinstance(a, np.ndarray) and a.dtype == want[0] and a.shape == want[1]
                         and a.flags.c_contiguous)
        if not ok:
            raise ValueError("QPanels: the packed arrays do not have the quantized panel layout")


_CHUNK_ROWS = 4096  # rows packed between two release() calls


def _check_type(ggml_type) -> int:
    tid = int(ggml_type)
    if tid not in NATIVE_TYPES:
        name = GGML_TYPES[tid].name if tid in GGML_TYPES else str(tid)
        raise ValueError(f"native storage handles {', '.join(NATIVE_TYPES.values())}; got {name}")
    return tid


def _rows(raw: np.ndarray, tid: int, k: int, order) -> tuple[np.ndarray, np.ndarray]:
    """A part's stored rows (R, row_bytes), a view, and the stored row of each of its rows (order)."""
    t = GGML_TYPES[tid]
    if k <= 0 or k % t.block_size:
        raise ValueError(f"row length must be a positive multiple of {t.block_size}, got {k}")
    row_bytes = k // t.block_size * t.type_size
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError("raw rows must be a uint8 numpy array")
    if raw.size % row_bytes:
        raise ValueError(f"{t.name} rows of {k} elements take {row_bytes} bytes; "
                         f"{raw.size} bytes is not a whole number of rows")
    rows = np.ascontiguousarray(raw).reshape(-1, row_bytes)
    if order is None:
        return rows, np.arange(rows.shape[0], dtype=np.int64)
    order = np.ascontiguousarray(order, np.int64)
    if order.shape != (rows.shape[0],) or not np.array_equal(np.sort(order), np.arange(rows.shape[0])):
        raise ValueError(f"row order must be a permutation of 0..{rows.shape[0] - 1}")
    return rows, order


def _parts(parts: Sequence[tuple], tid: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for part in parts:
        raw, order = part[0], part[1]
        if len(part) > 2 and int(part[2]) != tid:
            raise ValueError(f"pack_parts: a part of type {GGML_TYPES.get(int(part[2]), part[2])!s} in a "
                             f"{NATIVE_TYPES[tid]} matrix; concatenated parts must share one type")
        out.append(_rows(raw, tid, k, order))
    if sum(o.shape[0] for _, o in out) == 0:
        raise ValueError("no rows to pack")
    return out


def _new_panels(tid: int, shape_of, lead: tuple = ()) -> dict:
    """Uninitialized panel arrays (uint16 scales), `lead` axes first, the last panel zeroed (its rows
    past the matrix's end are padding)."""
    out = {}
    for name, want in shape_of.items():
        if want is not None:
            a = aligned_empty(lead + want[1], want[0])
            a[(slice(None),) * len(lead) + (-1,)] = 0
            out[name] = a
    return out


def _pack_into(tid: int, out: dict, srcs: list, release=None) -> None:
    """Each part's rows, in order, into the panel arrays `out` (one matrix), by repack's kernel;
    with `release`, a chunk of rows at a time, release(r0, r1) after rows r0..r1 are copied."""
    plan = repack.plan(tid)
    r0 = 0
    for rows, order in srcs:
        step = _CHUNK_ROWS if release is not None else max(1, order.shape[0])
        for c0 in range(0, order.shape[0], step):
            c1 = min(order.shape[0], c0 + step)
            repack.pack_rows(plan, rows, order[c0:c1], r0 + c0, out)
            if release is not None:
                release(r0 + c0, r0 + c1)
        r0 += order.shape[0]


def _quiet_scales(tid: int, out: dict) -> None:
    """The packed fp16 scales (and mins) with their signaling NaNs quieted (module docstring)."""
    for name in ("d", "m"):
        if name in out and not (name == "d" and tid == MXFP4):  # MXFP4's d: E8M0 bytes
            repack.quiet_snans(out[name])


def pack_parts(parts: Sequence[tuple], ggml_type: int, k: int,
               release: Callable[[int, int], None] | None = None) -> QPanels:
    """Concatenate block rows of one type and pack them: `parts` is [(raw, order), ...] or
    [(raw, order, part_type), ...], `raw` a uint8 array of whole rows (any shape, e.g.
    `gguf.tensor_bytes(name)`), `order` None or a permutation (row i of the part is raw row order[i],
    as `rows[order]`), `part_type` the part's ggml type id, checked against `ggml_type` (pass it: bytes
    of another type may happen to make a whole number of rows). Equivalent to packing
    `np.concatenate([dequantize(raw)[order] ...])` for the float path. `release(r0, r1)`, if given,
    is called as soon as rows r0..r1 of the concatenation have been copied into the panels: one
    large part (a token table) can then let the file's pages of those rows go as packing proceeds,
    rather than hold the whole file part resident next to its packed copy."""
    tid = _check_type(ggml_type)
    srcs = _parts(parts, tid, k)
    n = sum(o.shape[0] for _, o in srcs)
    out = _new_panels(tid, _shapes(tid, -(-n // QPANEL), k))
    _pack_into(tid, out, srcs, release)
    _quiet_scales(tid, out)
    return QPanels(tid, n, k, out["qs"], out["d"], out.get("m"), out.get("sc"), out.get("qh"))


def pack_stack(layers: Sequence[Sequence[tuple]], ggml_type: int, k: int,
               done: Callable[[int], None] | None = None) -> QPanels:
    """`stack([pack_parts(parts, ggml_type, k) for parts in layers])`, packed straight into the stack
    (no per-layer copy); `done(li)` is called once layer li is in (its file pages may go)."""
    tid = _check_type(ggml_type)
    n = None
    out = {}
    for li, parts in enumerate(layers):
        srcs = _parts(parts, tid, k)
        rows = sum(o.shape[0] for _, o in srcs)
        if n is None:
            n = rows
            out = _new_panels(tid, _shapes(tid, -(-n // QPANEL), k), (len(layers),))
        elif rows != n:
            raise ValueError("stack: the matrices differ in type or shape")
        _pack_into(tid, {name: a[li] for name, a in out.items()}, srcs)
        if done is not None:
            done(li)
    _quiet_scales(tid, out)
    return QPanels(tid, n, k, out["qs"], out["d"], out.get("m"), out.get("sc"), out.get("qh"))


def pack_quantized(raw_rows: np.ndarray, ggml_type: int, k: int, row_order: np.ndarray | None = None) -> QPanels:
    """One matrix: raw block rows (N, row_bytes) uint8 (or its flat bytes) of type `ggml_type`,
    row length `k` elements, optionally reordered by `row_order`."""
    return pack_parts([(raw_rows, row_order)], ggml_type, k)


def stack(layers: Iterable[QPanels], n: int | None = None) -> QPanels:
    """Equal-shaped QPanels of one type (one per layer) -> one QPanels whose arrays have a leading
    layer axis, for the forward pass (the CPU's `loaders.layer` picks one). Each layer is copied into the stack
    as it comes, so that `layers` may be an iterator of `n` layers packed on demand: packing then
    holds the stack and one layer, not every layer twice."""
    n = len(layers) if n is None else n
    it = iter(layers)
    first = next(it)
    fields = ("qs", "d", "m", "sc", "qh")
    out = {}
    for f in fields:
        a = getattr(first, f)
        out[f] = None if a is None else np.empty((n,) + a.shape, a.dtype)
    count = 0
    for q in itertools.chain([first], it):
        if count == n:
            raise ValueError(f"stack: more than {n} matrices")
        if (q.ggml_type, q.n, q.k, q.qs.shape) != (first.ggml_type, first.n, first.k, first.qs.shape):
            raise ValueError("stack: the matrices differ in type or shape")
        for f in fields:
            a = getattr(q, f)
            if a is not None:
                out[f][count] = a
        count += 1
    if count != n:
        raise ValueError(f"stack: {count} matrices, expected {n}")
    return QPanels(first.ggml_type, first.n, first.k, *(out[f] for f in fields))


def layer_of(st: QPanels, li: int) -> QPanels:
    """Layer li of a stack (`stack`'s inverse for one layer): views, no copies."""
    return QPanels(st.ggml_type, st.n, st.k,
                   *(None if a is None else a[li] for a in (st.qs, st.d, st.m, st.sc, st.qh)))


# ---------------------------------------------------------------------------------------------------
# Matrix kinds whose rows are not all one storage type.

@dataclass(frozen=True)
class MixedPanels:
    """A matrix kind, stacked over layers, whose rows are not one storage type: layers of different
    types (a Q4_K_M file's ffn_down: Q4_K in some layers, Q6_K in others) or a layer's rows in runs
    of different types ([wq; wk] Q5_0 and wv Q8_0). Each run (a segment) starts at an output row that
    is a multiple of 64, so that every prefill group of 64 outputs and every decode unit of 32 lies in
    one segment and is read exactly as a matrix of the segment's type would be: the same weights in
    the same sums.

    parts: one storage per kind (a QPanels without the layer axis, or float panels (P, k, 64) of
    float32 or fp16 bits; in the integer mode an `intpanels.IntPanels` in a QPanels' place), the
    panels of all its segments one after another (a quantized segment padded with a zero panel to an
    even count, so that a prefill pair never straddles two).
    table: (L, S + 1, 4) int64, row s of layer l its segment s as (part, first panel in the part,
    first output row, first decode unit); rows past a layer's segments, and the last, are
    (-1, 0, n, the layer's decode units)."""

    n: int
    k: int
    parts: tuple
    table: np.ndarray

    @property
    def type_name(self) -> str:
        return "+".join(kind_name(p) for p in self.parts)

    def arrays(self) -> list[np.ndarray]:
        return [a for p in self.parts for a in ([p] if isinstance(p, np.ndarray) else p.arrays())]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def check(self) -> None:
        """Raise unless the parts and the table fit each other (the kernels read raw pointers)."""
        t = self.table
        ok = isinstance(t, np.ndarray) and t.dtype == np.int64 and t.ndim == 3 and t.shape[2] == 4 and t.shape[1] >= 2
        ok = ok and t.flags.c_contiguous and bool(self.parts)
        for p in self.parts if ok else ():
            if not isinstance(p, np.ndarray):  # QPanels, or the integer mode's IntPanels
                p.check()
                ok = ok and p.k == self.k
            else:
                ok = ok and (isinstance(p, np.ndarray) and p.dtype in (np.float32, np.uint16) and p.ndim == 3
                             and p.shape[1:] == (self.k, LANES) and p.flags.c_contiguous)
        for lt in t if ok else ():
            ok = ok and tuple(lt[-1]) == (-1, 0, self.n, lt[-1, 3]) and lt[0, 2] == 0
            for s in range(t.shape[1] - 1):
                part, p0, r0, u0 = (int(v) for v in lt[s])
                r1, u1 = int(lt[s + 1, 2]), int(lt[s + 1, 3])
                if part < 0:
                    ok = ok and (r0, u0) == (r1, u1) == (self.n, lt[-1, 3])
                    continue
                if not (0 <= part < len(self.parts) and r0 % LANES == 0 and r0 < r1 <= self.n and u0 == r0 // QPANEL):
                    ok = False
                    break
                st = self.parts[part]
                quant = not isinstance(st, np.ndarray)
                need = -(-(r1 - r0) // (QPANEL if quant else LANES))
                ok = ok and u1 - u0 == (need if quant else 2 * need) and 0 <= p0 and p0 + need <= st_panels(st)
                ok = ok and (not quant or (p0 % 2 == 0 and p0 + need + need % 2 <= st_panels(st)))
        if not ok:
            raise ValueError("MixedPanels: the parts and the segment table do not fit")


def st_panels(st) -> int:
    return st.shape[0] if isinstance(st, np.ndarray) else st.qs.shape[0]


def kind_name(st) -> str:
    """A part's storage type name: its quantized type's, or "f16"/"f32" for float panels."""
    if not isinstance(st, np.ndarray):
        return st.type_name
    return "f16" if st.dtype == np.uint16 else "f32"


def pack_mixed(layers: Sequence[Sequence[tuple]], k: int) -> MixedPanels:
    """Layers of segments -> MixedPanels. `layers[l]` is layer l's segments in row order, each
    (key, rows, make): key a NATIVE_TYPES id, "f16" or "f32"; rows its row count; make() its
    storage: QPanels of that type, or float panels (ceil(rows / 64), k, 64) of fp16 bits ("f16") or
    float32. Segments must start at rows that are multiples of 64 and the layers must have equal row
    counts. make() is called once per segment, in order, its result copied into its part and dropped,
    so that packing holds the parts and one segment."""
    keys, panels, n = [], {}, None
    for segs in layers:
        r0 = 0
        for key, rows, _ in segs:
            if r0 % LANES or rows <= 0:
                raise ValueError(f"pack_mixed: a segment starts at row {r0}, not a multiple of {LANES}")
            if key not in panels:
                keys.append(key)
                panels[key] = 0
            quant = key not in ("f16", "f32")
            np_ = -(-rows // (QPANEL if quant else LANES))
            panels[key] += np_ + (np_ % 2 if quant else 0)
            r0 += rows
        if n is not None and r0 != n:
            raise ValueError("pack_mixed: the layers differ in row count")
        n = r0
    # parts in one order whatever the layers' order (quant types by id, then f16, f32): a set of types
    # is one storage type for the kernels, compiled once, not once per order of first appearance
    keys.sort(key=lambda key: (isinstance(key, str), str(key) if isinstance(key, str) else int(key)))
    S = max(len(segs) for segs in layers)
    table = np.zeros((len(layers), S + 1, 4), np.int64)
    parts: dict = {}
    fill = dict.fromkeys(keys, 0)
    for li, segs in enumerate(layers):
        r0 = 0
        for s, (key, rows, make) in enumerate(segs):
            st = make()
            quant = key not in ("f16", "f32")
            if quant:
                _check_type(key)
                if not (isinstance(st, QPanels) and st.ggml_type == key and st.n == rows and st.k == k):
                    raise ValueError("pack_mixed: a segment's storage does not match its key")
                if key not in parts:
                    parts[key] = _empty_qpanels(key, panels[key], k)
                _put(parts[key], fill[key], st)
            else:
                want = np.uint16 if key == "f16" else np.float32
                if not (isinstance(st, np.ndarray) and st.dtype == want and st.shape == (-(-rows // LANES), k, LANES)):
                    raise ValueError("pack_mixed: a segment's storage does not match its key")
                if key not in parts:
                    parts[key] = aligned_empty((panels[key], k, LANES), want)
                parts[key][fill[key]:fill[key] + st.shape[0]] = st
            table[li, s] = (keys.index(key), fill[key], r0, r0 // QPANEL)
            np_ = st_panels(st)
            fill[key] += np_ + (np_ % 2 if quant else 0)
            r0 += rows
            last_units = np_ if quant else 2 * np_
            del st
        table[li, len(segs):] = (-1, 0, n, table[li, len(segs) - 1, 3] + last_units)
    mixed = MixedPanels(n, k, tuple(parts[key] for key in keys), table)
    mixed.check()
    return mixed


def _empty_qpanels(tid: int, P: int, k: int) -> QPanels:
    """Zero quantized panels of type tid, P panels."""
    arrays = {name: np.zeros(want[1], want[0]) for name, want in _shapes(tid, P, k).items() if want is not None}
    return QPanels(tid, P * QPANEL, k, arrays["qs"], arrays["d"], arrays.get("m"), arrays.get("sc"), arrays.get("qh"))


def _put(part: QPanels, p0: int, seg: QPanels) -> None:
    """Copy seg's panels into part at panel p0."""
    for a, b in zip(part.arrays(), seg.arrays()):
        a[p0:p0 + b.shape[0]] = b
