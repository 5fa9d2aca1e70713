"""A small GGUF reader: memory-mapped, validated, zero-copy tensor views.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count,
the metadata key/values, the tensor infos (name, n_dims, dims, type, offset), padding to
`general.alignment`, then the tensor data. Everything is checked against the file size before any
tensor byte is read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError
from .ggml import GGML_TYPES
from .pages import map_file, release_pages

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Arrays of arrays are read recursively: a bound keeps a file of nested 12-byte array headers from
# exhausting Python's stack (no known model nests more than 2 deep).
MAX_ARRAY_DEPTH = 16

# Metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_U64 = struct.Struct("<Q")
_SCALAR = {
    UINT8: np.dtype("<u1"), INT8: np.dtype("<i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("<u1"),
    UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Bounds-checked sequential reads over the mapped bytes."""

    def __init__(self, path: Path, buf: np.ndarray):
        # A plain ndarray view of the map: slicing an np.memmap runs its __array_finalize__ each time,
        # which made a 262,144-token vocabulary's reads several times slower.
        self.path, self.buf, self.pos = path, buf.view(np.ndarray), 0

    def take(self, n: int, field: str) -> np.ndarray:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFormatError(
                self.path, field,
                f"needs {n} bytes at offset {self.pos} but the file has {len(self.buf)} bytes (truncated?)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, dtype: np.dtype, field: str):
        return self.take(dtype.itemsize, field).view(dtype)[0].item()

    def u32(self, field: str) -> int:
        return self.scalar(_SCALAR[UINT32], field)

    def u64(self, field: str) -> int:
        return self.scalar(_SCALAR[UINT64], field)

    def string(self, field: str) -> str:
        n = self.u64(field + " (string length)")
        raw = self.take(n, field).tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(self.path, field, f"string is not valid UTF-8 ({e.reason})") from None

    def strings(self, n: int, field: str) -> list[str]:
        """n strings in a row (a vocabulary): `string` n times, read with struct from one memoryview
        (a NumPy view per string made a 262,144-token vocabulary take a second); the same errors."""
        mv, pos, end = memoryview(self.buf), self.pos, len(self.buf)
        unpack, out = _U64.unpack_from, []
        for i in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.take(8, f"{field}[{i}] (string length)")  # raises: truncated
            (length,) = unpack(mv, pos)
            if pos + 8 + length > end:
                self.pos = pos + 8
                self.take(length, f"{field}[{i}]")  # raises: truncated
            try:
                out.append(str(mv[pos + 8:pos + 8 + length], "utf-8"))
            except UnicodeDecodeError as e:
                raise ModelFormatError(self.path, f"{field}[{i}]", f"string is not valid UTF-8 ({e.reason})") from None
            pos += 8 + length
        self.pos = pos
        return out

    def value(self, vtype: int, field: str, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            v = self.scalar(_SCALAR[vtype], field)
            return bool(v) if vtype == BOOL else v
        if vtype == STRING:
            return self.string(field)
        if vtype == ARRAY:
            etype = self.u32(field + " (array element type)")
            n = self.u64(field + " (array length)")
            if etype in _SCALAR:
                dt = _SCALAR[etype]
                if n * dt.itemsize > len(self.buf) - self.pos:
                    raise ModelFormatError(self.path, field, f"array of {n} elements runs past the end of the file")
                arr = self.take(n * dt.itemsize, field).view(dt)
                return arr.astype(bool) if etype == BOOL else arr
            if etype == ARRAY and depth >= MAX_ARRAY_DEPTH:
                raise ModelFormatError(self.path, field, f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
            if etype in (STRING, ARRAY):
                # Every element takes at least 8 bytes; this bounds n before looping.
                if n > (len(self.buf) - self.pos) // 8:
                    raise ModelFormatError(self.path, field, f"array of {n} elements runs past the end of the file")
                if etype == STRING:
                    return self.strings(n, field)
                return [self.value(etype, f"{field}[{i}]", depth + 1) for i in range(n)]
            raise ModelFormatError(self.path, field, f"unknown array element type {etype}")
        raise ModelFormatError(self.path, field, f"unknown metadata value type {vtype} (expected 0-12)")


class GGUFFile:
    """A parsed GGUF file. `metadata` maps keys to Python values (numeric arrays as NumPy arrays,
    string arrays as lists); `tensors` maps names to `TensorInfo`; `tensor_bytes(name)` and
    `tensor_view(name)` return zero-copy views into the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFormatError(self.path, "path", "no such file")
        if self.path.is_dir():
            raise ModelFormatError(self.path, "path", "is a directory, expected a .gguf file")
        size = self.path.stat().st_size
        if size < 24:
            raise ModelFormatError(self.path, "header", f"file is {size} bytes, too short for a GGUF header (24 bytes)")
        self.data = map_file(self.path)
        cur = _Cursor(self.path, self.data)
        magic = cur.take(4, "magic").tobytes()
        if magic != GGUF_MAGIC:
            raise ModelFormatError(self.path, "magic", f"expected b'GGUF', found {magic!r}: not a GGUF file")
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise ModelFormatError(self.path, "version", f"GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors = cur.u64("tensor_count")
        n_kv = cur.u64("metadata_kv_count")
        # Each KV needs >= 8+1+4 bytes and each tensor info >= 8+4+8+4+8; reject absurd counts early.
        if n_kv > size // 13 or n_tensors > size // 32:
            raise ModelFormatError(self.path, "header",
                                   f"{n_tensors} tensors / {n_kv} metadata entries cannot fit in {size} bytes")

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata[{i}].key")
            if key in self.metadata:
                raise ModelFormatError(self.path, key, "duplicate metadata key")
            vtype = cur.u32(f"{key} (value type)")
            self.metadata[key] = cur.value(vtype, key)

        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align % 8:
            raise ModelFormatError(self.path, "general.alignment", f"expected a positive multiple of 8, found {align!r}")
        self.alignment = align

        raw_infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor[{i}].name")
            if len(name.encode()) > 64:
                raise ModelFormatError(self.path, f"tensor[{i}].name", f"name {name[:80]!r} is longer than 64 bytes")
            n_dims = cur.u32(f"{name}.n_dims")
            if not 1 <= n_dims <= 4:
                raise ModelFormatError(self.path, f"{name}.n_dims", f"expected 1-4 dimensions, found {n_dims}")
            dims = [cur.u64(f"{name}.dims[{d}]") for d in range(n_dims)]
            gtype = cur.u32(f"{name}.type")
            offset = cur.u64(f"{name}.offset")
            raw_infos.append((name, dims, gtype, offset))

        data_start = -(-cur.pos // align) * align
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, gtype, offset in raw_infos:
            if name in self.tensors:
                raise ModelFormatError(self.path, name, "duplicate tensor name")
            if gtype not in GGML_TYPES:
                raise ModelFormatError(self.path, f"{name}.type",
                                       f"unknown or unsupported tensor type {gtype} (supported: "
                                       + ", ".join(t.name for t in GGML_TYPES.values()) + ")")
            t = GGML_TYPES[gtype]
            if any(d == 0 for d in dims):
                raise ModelFormatError(self.path, f"{name}.dims", f"zero-sized dimension in {dims}")
            n = int(np.prod(dims, dtype=object))
            if dims[0] % t.block_size:
                raise ModelFormatError(self.path, f"{name}.dims",
                                       f"row length {dims[0]} is not a multiple of {t.name}'s block size {t.block_size}")
            nbytes = n // t.block_size * t.type_size
            if offset % align:
                raise ModelFormatError(self.path, f"{name}.offset", f"offset {offset} is not aligned to {align}")
            start = data_start + offset
            if start + nbytes > size:
                raise ModelFormatError(self.path, f"{name}.offset",
                                       f"tensor data [{start}, {start + nbytes}) runs past the end of the file ({size} bytes)")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), gtype, start, nbytes)

    def drop_metadata(self, prefixes: tuple[str, ...]) -> None:
        """Forget the metadata values whose keys start with one of `prefixes` (read already, e.g. by
        the tokenizer), and let go of the pages of the header: metadata values are copies, but numeric
        arrays, views of the map that a later read faults back in. Gemma 3's vocabulary is 262,144
        strings (23 MiB; the tokenizer keeps its own compact copy) in 6 MiB of header pages, which
        would otherwise stay resident until the checkpoint's tensors are dropped, after the load."""
        for key in [k for k in self.metadata if k.startswith(prefixes)]:
            del self.metadata[key]
        release_pages(self.data, 0, self.data_offset)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes, a zero-copy uint8 view of the map."""
        info = self.tensors[name]
        return self.data[info.offset:info.offset + info.nbytes]

    def release(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        """Let go of the pages of the tensor's bytes lo..hi (default: all) once they are copied out
        (`pages.release_pages`)."""
        info = self.tensors[name]
        release_pages(self.data, info.offset + lo, info.offset + (info.nbytes if hi is None else hi))

    def tensor_view(self, name: str) -> np.ndarray:
        """A zero-copy typed view for F32/F16/BF16 tensors (BF16 as uint16 bits), in numpy shape order;
        for block-quantized types the raw bytes shaped (rows, bytes per row)."""
        info = self.tensors[name]
        raw = self.tensor_bytes(name)
        kind = info.type_name
        if kind == "F32":
            return raw.view("<f4").reshape(info.shape)
        if kind == "F16":
            return raw.view("<f2").reshape(info.shape)
        if kind == "BF16":
            return raw.view("<u2").reshape(info.shape)
        return raw.reshape(info.shape[:-1] + (-1,))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFormatError(self.path, key, "required metadata key is missing")
        return self.metadata[key]
