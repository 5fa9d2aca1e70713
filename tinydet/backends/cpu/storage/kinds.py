"""A storage kind as a numba type: the tag that every storage tuple carries in its first slot.

What the kernels take for a packed matrix (`as_storage`, from `packing/`'s panels) is float panels,
an array whose numba type (float32 or uint16 elements) is its kind, or a flat tuple whose first slot
is a `Kind`, a value with no data (`Kind`) whose numba type `StorageKind` names the kind (and, for
quantized kinds, the ggml type):

  ("native", Q4_1)   (tag, qs, d, m, sc, qh)      `QPanels`' arrays, None where the type has none
  ("int8", Q4_1)     (tag, qs, d, m, sc, qh)      `IntPanels`' arrays
  ("mixed",)         (tag, table, 6 slots per part)   `MixedPanels`: each part a quantized
  ("int8-mixed",)                                      storage, or (f32/f16 tag, panels, 4 Nones)

The tuples are flat because numba's parallel regions take no nested tuples. Every interface function
of `loaders.py` looks the kind up once, by type, in the one table (`storage/table.py`), and returns
that kind's implementation: no code guesses a kind from a tuple's length or its arrays' dtypes. The tag
is typed like None (an opaque pointer, never read), so it costs nothing at run time, and its value is
typed at C speed (`Kind`); its type pickles with the compiled functions of numba's on-disk cache.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.core.imputils import lower_constant
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox

from ....packing.intpanels import IntPanels
from ....packing.layout import MixedPanels, QPanels, kind_name
from ....packing.names import NATIVE_TYPES


class StorageKind(types.Opaque):
    """The numba type of a storage kind's tag: `kind` the family (a key of the table), `qtype` the
    ggml type name of a quantized kind, else None."""

    def __init__(self, kind: str, qtype: str | None = None):
        self.kind, self.qtype = kind, qtype
        super().__init__(name=f"kind[{kind}]" if qtype is None else f"kind[{kind}:{qtype}]")


register_model(StorageKind)(models.OpaqueModel)


class Kind(np.ndarray):
    """A storage kind's tag value (one per kind: `tag`): a zero-length array whose structured dtype's one
    field names the kind ("native:Q4_1"). An array, not a plain object, because numba's dispatcher
    fingerprints arrays (and tuples of them) in C and caches their types by fingerprint, where any
    other object sends the whole argument tuple through Python's typeof at every call (SmolLM2's
    3072 x 576 Q4_1 product called from Python: 45 us more per call)."""

    @property
    def kind(self) -> str:
        return self.dtype.names[0].partition(":")[0]

    @property
    def qtype(self) -> str | None:
        return self.dtype.names[0].partition(":")[2] or None


_TAGS: dict = {}


def tag(kind: str, qtype: str | None = None) -> Kind:
    """The tag of a kind (the same object every time)."""
    key = (kind, qtype)
    if key not in _TAGS:
        name = kind if qtype is None else f"{kind}:{qtype}"
        _TAGS[key] = np.zeros(0, np.dtype([(name, np.uint8)])).view(Kind)
    return _TAGS[key]


@typeof_impl.register(Kind)
def _typeof(val, c):
    return StorageKind(val.kind, val.qtype)


@unbox(StorageKind)
def _unbox(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


@lower_constant(StorageKind)
def _constant(context, builder, ty, pyval):
    return context.get_dummy_value()


def as_storage(w):
    """What the kernels take for a packed matrix (the module docstring): float panels as they are,
    `QPanels` and `IntPanels` as (tag, qs, d, m, sc, qh), `MixedPanels` as (tag, table, then 6 slots
    per part: a quantized part's tuple, or a float part's tag, its panels and four Nones), of kind
    "int8-mixed" where a part is of the integer mode, else "mixed"."""
    if isinstance(w, QPanels):
        return (tag("native", w.type_name), w.qs, w.d, w.m, w.sc, w.qh)
    if isinstance(w, IntPanels):
        return (tag("int8", NATIVE_TYPES[w.ggml_type]), w.qs, w.d, w.m, w.sc, w.qh)
    if isinstance(w, MixedPanels):
        slots = [(tag(kind_name(p)), p, None, None, None, None) if isinstance(p, np.ndarray) else as_storage(p)
                 for p in w.parts]
        kind = "int8-mixed" if any(s[0].kind == "int8" for s in slots) else "mixed"
        return (tag(kind), w.table) + tuple(a for s in slots for a in s)
    return w


_TABLE: dict = {}


def register(table: dict) -> None:
    """Fill the table kind -> module (`storage/table.py` does, once)."""
    _TABLE.update(table)


def kind_of(w) -> StorageKind:
    """The kind of a storage's numba type: float panels' from their elements, a tuple's from its tag."""
    if isinstance(w, types.Array):
        return StorageKind("f16" if w.dtype == types.uint16 else "f32")
    if isinstance(w, types.BaseTuple) and len(w) and isinstance(w[0], StorageKind):
        return w[0]
    raise TypeError(f"not a storage of the CPU kernels: {w}")


def module(kind: str):
    """The module that implements storage kind `kind` (the table's row)."""
    if kind not in _TABLE:
        raise TypeError(f"no storage kind {kind!r} in the table (storage/table.py)")
    return _TABLE[kind]


def impl(w):
    """The module that implements the storage kind of numba type w."""
    return module(kind_of(w).kind)
