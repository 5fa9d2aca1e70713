"""A tiny GGUF writer for tests: builds valid files and deliberately broken ones."""

from __future__ import annotations

import struct

import numpy as np

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
        BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_NP = {np.dtype(np.uint8): UINT8, np.dtype(np.int8): INT8, np.dtype(np.uint16): UINT16, np.dtype(np.int16): INT16,
       np.dtype(np.uint32): UINT32, np.dtype(np.int32): INT32, np.dtype(np.float32): FLOAT32,
       np.dtype(np.uint64): UINT64, np.dtype(np.int64): INT64, np.dtype(np.float64): FLOAT64, np.dtype(bool): BOOL}


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def typed(vtype: int, value):
    """Mark a metadata value with an explicit GGUF type."""
    return ("__typed__", vtype, value)


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, tuple) and len(v) == 3 and v[0] == "__typed__":
        _, t, val = v
        if t == ARRAY:
            et, items = val
            body = b"".join(_value(x if isinstance(x, tuple) and x[:1] == ("__typed__",) else typed(et, x))[1]
                            for x in items)
            return ARRAY, struct.pack("<IQ", et, len(items)) + body
        if t == STRING:
            return STRING, _str(val)
        return t, struct.pack(_FMT[t], val)
    if isinstance(v, bool):
        return BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        return (INT32, struct.pack("<i", v)) if -2**31 <= v < 2**31 else (UINT64, struct.pack("<Q", v))
    if isinstance(v, float):
        return FLOAT32, struct.pack("<f", v)
    if isinstance(v, str):
        return STRING, _str(v)
    if isinstance(v, np.ndarray):
        et = _NP[v.dtype]
        return ARRAY, struct.pack("<IQ", et, v.size) + np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")).tobytes()
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return ARRAY, struct.pack("<IQ", STRING, len(v)) + b"".join(_str(x) for x in v)
        parts = [_value(x) for x in v]
        et = parts[0][0] if parts else INT32
        return ARRAY, struct.pack("<IQ", et, len(v)) + b"".join(p[1] for p in parts)
    raise TypeError(f"cannot encode {type(v)}")


def build(metadata: dict, tensors: list[tuple[str, tuple[int, ...], int, bytes]], version: int = 3,
          alignment: int = 32) -> bytes:
    """metadata: key -> value; tensors: (name, numpy-order shape, ggml type, raw bytes)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    for k, v in metadata.items():
        t, body = _value(v)
        out += _str(k) + struct.pack("<I", t) + body
    offset = 0
    offsets = []
    for name, shape, gtype, raw in tensors:
        out += _str(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", gtype, offset)
        offsets.append(offset)
        offset += -(-len(raw) // alignment) * alignment
    out += b"\0" * (-len(out) % alignment)
    for (_, _, _, raw), off in zip(tensors, offsets):
        out += raw + b"\0" * (-len(raw) % alignment)
    return bytes(out)


def rewrite(src, metadata_edits: dict | None = None, drop_keys=(), tensor_edits=None, version: int = 3) -> bytes:
    """Copy a GGUF read with tinydet's reader, changing metadata and tensors on the way."""
    from tinydet.formats.gguf import GGUFFile

    g = GGUFFile(src)
    meta = {}
    for k, v in g.metadata.items():
        if k in drop_keys:
            continue
        if isinstance(v, np.ndarray):
            v = np.array(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            v = typed(UINT32, v) if 0 <= v < 2**32 else typed(UINT64, v)
        meta[k] = v
    meta.update(metadata_edits or {})
    tensors = [(t.name, t.shape, t.ggml_type, g.tensor_bytes(t.name).tobytes()) for t in g.tensors.values()]
    if tensor_edits:
        tensors = tensor_edits(tensors)
    return build(meta, tensors, version=version)
