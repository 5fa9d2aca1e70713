"""Safetensors files, validated before any tensor byte is read.

Layout: an 8-byte little-endian header length N, N bytes of JSON
(`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`), then the data, with
offsets relative to its start. The header is checked here (sizes, bounds, overlaps, gaps), so a file
that lies gives a ModelFormatError, never a NumPy traceback. Once checked, a tensor's bytes are a view
of the mapped file (`tensor(name)`), dequantized like any stored type: F32 as is, F16 by NumPy's exact
widening, BF16 by a 16-bit shift (NumPy has no bfloat16)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError
from ..jsonfile import is_int as _is_int
from ..jsonfile import reject_duplicates as _reject_duplicates
from .checkpoint import Tensor
from .dequant import dequantize
from .ggml import BF16, F16, F32
from .pages import map_file, release_pages

# Safetensors dtypes -> bits per element (the format's full list); tinydet loads the float ones below.
ST_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
LOADABLE_DTYPES = {"F32": F32, "F16": F16, "BF16": BF16}  # -> the ggml storage type
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


# ---------------------------------------------------------------------------------------------------
# Numbers


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly: bfloat16 is the high half of a float32, so
    widening is a 16-bit shift (NaN payloads, infinities and subnormals included)."""
    u = np.ascontiguousarray(bits, dtype="<u2")
    return dequantize(u.view(np.uint8).reshape(-1), BF16, u.shape)


# ---------------------------------------------------------------------------------------------------
# Safetensors


@dataclass(frozen=True)
class STensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """A safetensors file whose header has been validated: `tensors` maps names to `STensor`,
    `metadata` is the header's `__metadata__` (str -> str). `tensor(name)` is a tensor as stored,
    `get(name)` its float32 value."""

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        if not path.is_file():
            raise ModelFormatError(path, "path", "no such file")
        size = path.stat().st_size
        if size < 8:
            raise ModelFormatError(path, "header length",
                                   f"file is {size} bytes, too short for the 8-byte header length")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                raise ModelFormatError(
                    path, "header length",
                    f"says the JSON header is {n} bytes, but the file has {size - 8} bytes after the length "
                    f"(and a header is 2..{MAX_HEADER_BYTES} bytes): not a safetensors file, or truncated")
            raw = f.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(path, "header", f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.startswith("{"):
            raise ModelFormatError(path, "header", "does not start with '{': not a safetensors file")
        try:
            header = json.loads(text, object_pairs_hook=_reject_duplicates(path, "header"))
        except json.JSONDecodeError as e:
            raise ModelFormatError(path, "header", f"is not valid JSON ({e.msg} at char {e.pos})") from None
        except RecursionError:
            # json's decoder recurses once per nesting level: a few thousand '[' exhaust the stack.
            raise ModelFormatError(path, "header", "is nested too deeply") from None
        if not isinstance(header, dict):
            raise ModelFormatError(path, "header", "expected a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise ModelFormatError(path, "__metadata__", "expected an object of string -> string")
        self.metadata: dict[str, str] = meta
        self.data_offset = data_start = 8 + n
        data_size = size - data_start

        tensors: dict[str, STensor] = {}
        spans = []
        for name, info in header.items():
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise ModelFormatError(path, name, "expected an object with exactly dtype, shape and data_offsets")
            dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or dtype not in ST_DTYPE_BITS:
                raise ModelFormatError(path, f"{name}.dtype",
                                       f"unknown dtype {dtype!r} (safetensors dtypes: {', '.join(ST_DTYPE_BITS)})")
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise ModelFormatError(path, f"{name}.shape", f"expected a list of non-negative integers, found {shape!r}")
            if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                    or not 0 <= offs[0] <= offs[1]):
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"expected [begin, end] with 0 <= begin <= end, found {offs!r}")
            bits = math.prod(shape) * ST_DTYPE_BITS[dtype]
            if bits % 8:
                raise ModelFormatError(path, f"{name}.shape", f"{shape} {dtype} elements do not fill whole bytes")
            begin, end = offs
            if end - begin != bits // 8:
                raise ModelFormatError(
                    path, f"{name}.data_offsets",
                    f"[{begin}, {end}) holds {end - begin} bytes, but shape {shape} of {dtype} needs {bits // 8}")
            if end > data_size:
                raise ModelFormatError(
                    path, f"{name}.data_offsets",
                    f"[{begin}, {end}) runs past the end of the data ({data_size} bytes after the header)")
            tensors[name] = STensor(name, dtype, tuple(shape), data_start + begin, end - begin)
            spans.append((begin, end, name))

        # The format requires the data to be exactly covered: sorted spans, no overlap, no gap.
        spans.sort()
        pos, prev = 0, None
        for begin, end, name in spans:
            if begin < pos:
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"[{begin}, {end}) overlaps tensor {prev!r}, which ends at {pos}")
            if begin > pos:
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"starts at {begin}, leaving a gap of {begin - pos} bytes after "
                                       + (repr(prev) if prev else "the header"))
            pos, prev = end, name
        if pos != data_size:
            raise ModelFormatError(path, "data_offsets",
                                   f"tensors cover {pos} bytes but the file has {data_size} bytes of data "
                                   "(trailing bytes, or a truncated header)")
        self.tensors = tensors
        self._map = None

    def tensor(self, name: str) -> Tensor:
        """The tensor as stored (a view of the mapped file), its value float32 (`formats.Tensor`)."""
        t = self.tensors[name]
        if t.dtype not in LOADABLE_DTYPES:
            raise ModelFormatError(self.path, f"{name}.dtype",
                                   f"dtype {t.dtype} is not supported (supported: {', '.join(LOADABLE_DTYPES)})")
        if self._map is None:
            self._map = map_file(self.path)
        data = self._map[t.offset:t.offset + t.nbytes]

        def release(lo=0, hi=None):
            release_pages(self._map, t.offset + lo, t.offset + (t.nbytes if hi is None else hi))

        return Tensor(data, LOADABLE_DTYPES[t.dtype], t.shape, release=release)

    def raw(self, name: str, dtype: str) -> tuple[np.ndarray, object]:
        """(the tensor's bytes, a view of the mapped file; release()) for a tensor that must be of
        `dtype` (MXFP4's U8 blocks and scales: not values on their own)."""
        t = self.tensors[name]
        if t.dtype != dtype:
            raise ModelFormatError(self.path, f"{name}.dtype", f"expected {dtype}, found {t.dtype}")
        if self._map is None:
            self._map = map_file(self.path)

        def release():
            release_pages(self._map, t.offset, t.offset + t.nbytes)

        return self._map[t.offset:t.offset + t.nbytes], release

    def get(self, name: str) -> np.ndarray:
        """The tensor as a C-contiguous float32 array (F16 and BF16 widened exactly)."""
        return self.tensor(name).float32()
