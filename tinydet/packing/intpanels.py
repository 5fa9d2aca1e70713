"""Weights of the integer mode (dtype "int8", `backends/cpu/intdot.py`): quantized panels whose quants
the integer block dots read 4 bytes to a 32-bit lane. Layout only: the bytes are the file's, moved.

Every type keeps the native panels of `layout.py` (32 rows side by side, fp16 scales as stored) but
Q8_0, whose int8 quants are regrouped:

  Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4  the native arrays as they are. A nibble word holds elements 8g .. 8g+7 of a block;
                    `w & 0x0F0F0F0F` is elements (0, 2, 4, 6) of the group, one per byte, and
                    `(w >> 4) & 0x0F0F0F0F` elements (1, 3, 5, 7): the activations are stored in that
                    order (`backends/cpu/actq.py`), so the words feed the byte dots with no shuffle.
  Q8_0              qs int8 (P, nb, 8, 32, 4): [p, b, 2g + h, j, i] = quant of element 32b + 8g + 2i + h
                    of row 32p + j, the same order. 1 B/weight, as in the file.

The arrays are `layout.QPanels`' (None where the type has no such array); the CPU kernels take them
as a storage tuple tagged "int8" (`backends/cpu/storage/kinds.as_storage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import K_QUANTS, QBLOCK, QK_K, Q4_K, Q5_0, Q5_K, Q6_K, QPanels, aligned_empty
from ..formats.ggml import MXFP4, Q4_0, Q4_1, Q8_0
from .names import NATIVE_TYPES

#: the types the integer mode computes in integers; others keep native mode's float path
INT_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4)


@dataclass(frozen=True)
class IntPanels:
    """A matrix (or a stack of matrices, one per layer) for the integer block dots."""

    ggml_type: int  # one of INT_TYPES
    n: int
    k: int
    qs: np.ndarray  # Q8_0: int8 (P, k/32, 8, 32, 4); the others: native uint32 (P, k/32, 4, 32)
    d: np.ndarray  # (P, k/32, 32) (K-quants: (P, k/256, 32)) uint16 fp16 bits (MXFP4: uint8), as QPanels.d
    m: np.ndarray | None = None  # Q4_1's mins, Q4_K/Q5_K's dmin
    sc: np.ndarray | None = None  # the K-quants' sub-block scales, as QPanels.sc
    qh: np.ndarray | None = None  # Q5_0/Q5_K's 5th bits, Q6_K's high 2 bits, as QPanels.qh

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.ggml_type] + ":int8"

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.qs, self.d, self.m, self.sc, self.qh) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def check(self) -> None:
        """Raise unless the arrays have this module's layout, one matrix (the kernels read raw pointers)."""
        t, k = self.ggml_type, self.k
        P = self.d.shape[0] if isinstance(self.d, np.ndarray) and self.d.ndim == 3 else -1
        nb, ns = k // QBLOCK, k // QK_K
        scale = ((np.uint16,), (P, ns if t in K_QUANTS else nb, 32))
        want = {"qs": ((np.int8,), (P, nb, 8, 32, 4)) if t == Q8_0 else ((np.uint32,), (P, nb, 4, 32)),
                "d": ((np.uint8,), (P, nb, 32)) if t == MXFP4 else scale,
                "m": scale if t in (Q4_1, Q4_K, Q5_K) else None,
                "sc": {Q4_K: ((np.uint8,), (P, ns, 12, 32)), Q5_K: ((np.uint8,), (P, ns, 12, 32)),
                       Q6_K: ((np.int8,), (P, ns, 16, 32))}.get(t),
                "qh": {Q5_0: ((np.uint32,), (P, nb, 32)), Q5_K: ((np.uint32,), (P, nb, 32)),
                       Q6_K: ((np.uint32,), (P, nb, 2, 32))}.get(t)}
        block = QK_K if t in K_QUANTS else QBLOCK
        ok = t in INT_TYPES and k > 0 and k % block == 0 and P * 32 >= self.n > 0
        for name, w in want.items() if ok else ():
            a = getattr(self, name)
            if w is None:
                ok = ok and a is None
            else:
                ok = ok and isinstance(a, np.ndarray) and a.dtype in w[0] and a.shape == w[1] and a.flags.c_contiguous
        if not ok:
            raise ValueError("IntPanels: the packed arrays do not have the integer panel layout")


def q8_lanes(qs: np.ndarray) -> np.ndarray:
    """Native Q8_0 quants (..., P, K, 32) -> (..., P, K/32, 8, 32, 4) (the module docstring)."""
    lead, (P, K, L) = qs.shape[:-3], qs.shape[-3:]
    a = qs.reshape(lead + (P, K // QBLOCK, 4, 4, 2, L))  # k = 32b + 8g + 2i + h -> (b, g, i, h)
    nd = len(lead)
    out = aligned_empty(lead + (P, K // QBLOCK, 8, L, 4), np.int8)
    axes = tuple(range(nd)) + tuple(nd + a for a in (0, 1, 2, 4, 5, 3))  # (P, b, g, h, j, i)
    out[...] = a.transpose(axes).reshape(out.shape)
    return out


def from_qpanels(qp: QPanels) -> IntPanels:
    """Native quantized panels (one matrix, or stacked over layers) -> IntPanels; Q4_0/Q4_1/Q5_0 share
    their arrays, Q8_0's quants are regrouped."""
    if qp.ggml_type not in INT_TYPES:
        raise ValueError(f"the integer mode computes {', '.join(NATIVE_TYPES[t] for t in INT_TYPES)}; "
                         f"got {qp.type_name}")
    qs = q8_lanes(qp.qs) if qp.ggml_type == Q8_0 else qp.qs
    return IntPanels(qp.ggml_type, qp.n, qp.k, qs, qp.d, qp.m, qp.sc, qp.qh)


def layer_of(st: IntPanels, li: int) -> IntPanels:
    """Layer li of a stack: views."""
    return IntPanels(st.ggml_type, st.n, st.k,
                     *(None if a is None else a[li] for a in (st.qs, st.d, st.m, st.sc, st.qh)))
