"""The CPU backend's weight layouts: float panels and quantized panels. Layout only: packing moves
bytes and never rounds anything (fp16's one rounding is `simd.to_f16_bits`, at load).

Float panels: W[N, K] -> Wp[ceil(N/64), K, 64], rows past N zero: the inner loop of the matrix
product runs over 64 independent outputs.

Quantized panels, for GGUF's block-quantized matrices (Q8_0, Q4_0, Q4_1), read by `loaders.py`: the
fp32 path dequantizes W[N, K] and packs it as float panels; the native path keeps GGUF's blocks and
rearranges them the same way, L = 32 rows (outputs, `QPANEL`) side by side, so that the kernel's
inner loop runs over L contiguous lanes just as it does for floats. With P = ceil(N / 32) panels and
K/32 blocks per row:

  Q8_0  qs  int8   (P, K, 32)         qs[p, k, j]    = quant k of row 32p+j                  1 B/weight
  Q4_0, qs  uint32 (P, K/32, 4, 32)   qs[p, b, g, j] = quants 32b+8g .. 32b+8g+7 of row    0.5 B/weight
  Q4_1                                32p+j, element 32b+8g+i in bits 4i..4i+3
  all   d   uint16 (P, K/32, 32)      fp16 bits of the scale d of block b of row 32p+j
  Q4_1  m   uint16 (P, K/32, 32)      fp16 bits of its min m

i.e. exactly GGUF's bytes per weight (34/32, 18/32, 20/32). The 4-bit quants are regrouped from ggml's
byte order (byte i: element i in the low nibble, element 16+i in the high one) into 32-bit words of 8
consecutive elements, so that one shift (and a mask or a table lookup) gives L lanes' quants for one
k: decode is compute-bound, and this costs fewer instructions than unpacking bytes (about 8% faster).

Rows past N (the last panel's padding) are zero bytes: weight 0, computed and never stored. The kernels
widen fp16 scales exactly (F16C where the compile target has it, else an integer conversion);
`formats.dequant` uses NumPy's float16 -> float32 cast. They agree on every value but signaling NaNs
(F16C quiets them), and a NaN's payload could in principle differ, so the packer stores NumPy's
float32 scales instead (the kernels accept either dtype) when any scale is a signaling NaN or its
integer widening differs from NumPy's.

Rows move whole, so Q/K un-permutation and concatenation ([wq; wk; wv], [w1; w3]) happen on the raw
block rows: `pack_parts([(raw_q, order_q), (raw_k, order_k), (raw_v, None)], type, dim)` is the matrix
the fp32 path builds by concatenating the dequantized rows in those orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...formats.ggml import GGML_TYPES, Q4_0, Q4_1, Q8_0
from .simd import HALF as QPANEL  # rows per quantized panel: the kernels' 32-lane vectors
from .simd import LANES, from_f16_bits

QBLOCK = 32  # elements per Q8_0 / Q4_0 / Q4_1 block

#: ggml type ids the native path handles -> type name.
NATIVE_TYPES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}


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


@dataclass(frozen=True)
class QPanels:
    """A quantized matrix W[n, k] in panel layout (see the module docstring)."""

    ggml_type: int  # Q8_0, Q4_0 or Q4_1
    n: int  # rows (outputs)
    k: int  # row length (inputs), a multiple of 32
    qs: np.ndarray  # Q8_0: int8 (P, k, 32); Q4_x: uint32 (P, k/32, 4, 32)
    d: np.ndarray  # (P, k/32, 32) uint16 fp16 bits, or float32
    m: np.ndarray | None = None  # Q4_1: like d; otherwise None

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.ggml_type]

    @property
    def n_panels(self) -> int:
        return self.qs.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the matrix reads (padding included)."""
        return self.qs.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)

    def check(self) -> None:
        """Raise unless the arrays have this module's layout (the kernels read raw pointers)."""
        P = self.qs.shape[0]
        nb = self.k // QBLOCK
        t = self.ggml_type
        if t == Q8_0:
            want = (np.int8, (P, self.k, QPANEL))
        elif t in (Q4_0, Q4_1):
            want = (np.uint32, (P, nb, 4, QPANEL))
        else:
            raise ValueError(f"QPanels: unsupported ggml type {t}")
        scales = [self.d] + ([self.m] if t == Q4_1 else [])
        if (self.k <= 0 or self.k % QBLOCK or (self.qs.dtype, self.qs.shape) != want or not self.qs.flags.c_contiguous
                or P * QPANEL < self.n or any(not isinstance(s, np.ndarray) or s.dtype not in (np.uint16, np.float32)
                                             or s.shape != (P, nb, QPANEL) or not s.flags.c_contiguous for s in scales)
                or (t != Q4_1 and self.m is not None)):
            raise ValueError("QPanels: the packed arrays do not have the quantized panel layout")


def as_storage(w):
    """What the kernels take for a matrix: float panels as they are, `QPanels` as the tuple (qs, d, m)."""
    return (w.qs, w.d, w.m) if isinstance(w, QPanels) else w


_CHUNK_ROWS = 4096  # rows regrouped at a time (bounds the temporaries)
_NIBBLE_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


def _check_type(ggml_type) -> int:
    tid = int(ggml_type)
    if tid not in NATIVE_TYPES:
        name = GGML_TYPES[tid].name if tid in GGML_TYPES else str(tid)
        raise ValueError(f"native storage handles {', '.join(NATIVE_TYPES.values())}; got {name}")
    return tid


def _rows(raw: np.ndarray, tid: int, k: int, order) -> np.ndarray:
    t = GGML_TYPES[tid]
    if k <= 0 or k % QBLOCK:
        raise ValueError(f"row length must be a positive multiple of {QBLOCK}, got {k}")
    row_bytes = k // QBLOCK * t.type_size
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError("raw rows must be a uint8 numpy array")
    if raw.size % row_bytes:
        raise ValueError(f"{t.name} rows of {k} elements take {row_bytes} bytes; "
                         f"{raw.size} bytes is not a whole number of rows")
    rows = np.asarray(raw).reshape(-1, row_bytes)
    if order is not None:
        order = np.asarray(order, np.int64)
        if order.shape != (rows.shape[0],) or not np.array_equal(np.sort(order), np.arange(rows.shape[0])):
            raise ValueError(f"row order must be a permutation of 0..{rows.shape[0] - 1}")
        rows = rows[order]
    return rows


def _scales(cols: np.ndarray, n_pad: int, P: int, nb: int) -> np.ndarray:
    """(N, nb, 2) fp16 bytes -> (P, nb, 32) uint16 bits, or float32 when the kernel's integer widening
    would not reproduce NumPy's cast bit for bit (only possible for NaN scales)."""
    bits = np.zeros((n_pad, nb), np.uint16)
    bits[:cols.shape[0]] = np.ascontiguousarray(cols).view("<u2").reshape(cols.shape[0], nb)
    bits = np.ascontiguousarray(bits.reshape(P, QPANEL, nb).transpose(0, 2, 1))
    want = bits.view(np.float16).astype(np.float32)  # quants._f16's widening
    # Signaling NaNs are the one input on which the kernels' widenings (integer, or F16C, which
    # quiets them) may differ from each other and from NumPy's.
    snan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0) & ((bits & 0x0200) == 0)
    if not snan.any() and np.array_equal(from_f16_bits(bits).view(np.uint32), want.view(np.uint32)):
        return bits
    return want


def pack_parts(parts: Sequence[tuple], ggml_type: int, k: int) -> QPanels:
    """Concatenate block rows of one type and pack them: `parts` is [(raw, order), ...] or
    [(raw, order, part_type), ...], `raw` a uint8 array of whole rows (any shape, e.g.
    `gguf.tensor_bytes(name)`), `order` None or a permutation (row i of the part is raw row order[i],
    as `rows[order]`), `part_type` the part's ggml type id, checked against `ggml_type` (pass it: bytes
    of another type may happen to make a whole number of rows). Equivalent to packing
    `np.concatenate([dequantize(raw)[order] ...])` for the float path."""
    tid = _check_type(ggml_type)
    blocks = []
    for part in parts:
        raw, order = part[0], part[1]
        if len(part) > 2 and int(part[2]) != tid:
            raise ValueError(f"pack_parts: a part of type {GGML_TYPES.get(int(part[2]), part[2])!s} in a "
                             f"{NATIVE_TYPES[tid]} matrix; concatenated parts must share one type")
        blocks.append(_rows(raw, tid, k, order))
    rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    n = rows.shape[0]
    if n == 0:
        raise ValueError("no rows to pack")
    nb = k // QBLOCK
    t = GGML_TYPES[tid]
    P = -(-n // QPANEL)
    n_pad = P * QPANEL
    b = rows.reshape(n, nb, t.type_size)
    if tid == Q8_0:
        q = np.zeros((n_pad, nb, QBLOCK), np.uint8)
        q[:n] = b[:, :, 2:34]
        qs = np.ascontiguousarray(q.reshape(P, QPANEL, k).transpose(0, 2, 1)).view(np.int8)
        return QPanels(tid, n, k, qs, _scales(b[:, :, 0:2], n_pad, P, nb))
    off = 2 if tid == Q4_0 else 4
    words = np.zeros((n_pad, nb, 4), np.uint32)
    for r0 in range(0, n, _CHUNK_ROWS):
        raw_q = b[r0:r0 + _CHUNK_ROWS, :, off:off + 16]
        nib = np.empty(raw_q.shape[:2] + (32,), np.uint32)
        nib[:, :, :16] = raw_q & np.uint8(15)  # elements 0..15
        nib[:, :, 16:] = raw_q >> np.uint8(4)  # elements 16..31
        nib = nib.reshape(nib.shape[0], nb, 4, 8) << _NIBBLE_SHIFTS
        words[r0:r0 + nib.shape[0]] = np.bitwise_or.reduce(nib, axis=3)
    qs = np.ascontiguousarray(words.reshape(P, QPANEL, nb, 4).transpose(0, 2, 3, 1))
    d = _scales(b[:, :, 0:2], n_pad, P, nb)
    m = _scales(b[:, :, 2:4], n_pad, P, nb) if tid == Q4_1 else None
    return QPanels(tid, n, k, qs, d, m)


def pack_quantized(raw_rows: np.ndarray, ggml_type: int, k: int, row_order: np.ndarray | None = None) -> QPanels:
    """One matrix: raw block rows (N, row_bytes) uint8 (or its flat bytes) of type `ggml_type`,
    row length `k` elements, optionally reordered by `row_order`."""
    return pack_parts([(raw_rows, row_order)], ggml_type, k)


def stack(layers: Sequence[QPanels]) -> QPanels:
    """Equal-shaped QPanels of one type (one per layer) -> one QPanels whose arrays have a leading
    layer axis, for the forward pass (`loaders.layer` picks one). Scales that are uint16 in some
    layers and float32 in others (only possible with NaN scales) are all stored as float32, widened
    as NumPy does."""
    first = layers[0]
    if any((q.ggml_type, q.n, q.k, q.qs.shape) != (first.ggml_type, first.n, first.k, first.qs.shape) for q in layers):
        raise ValueError("stack: the matrices differ in type or shape")

    def st(arrs):
        if len({a.dtype for a in arrs}) > 1:
            arrs = [a if a.dtype == np.float32 else a.view(np.float16).astype(np.float32) for a in arrs]
        out = np.empty((len(arrs),) + arrs[0].shape, arrs[0].dtype)
        for i, a in enumerate(arrs):
            out[i] = a
        return out

    return QPanels(first.ggml_type, first.n, first.k, st([q.qs for q in layers]), st([q.d for q in layers]),
                   None if first.m is None else st([q.m for q in layers]))
