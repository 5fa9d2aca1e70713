"""What a reader gives: a `Tensor` (a view of the file's bytes in its stored type, float32 on demand)
and a `Checkpoint` (config, tensors under canonical names, tokenizer, metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .dequant import dequantize
from .ggml import F32, GGML_TYPES, row_bytes

if TYPE_CHECKING:
    from ..arch import ArchSpec
    from ..config import ModelConfig
    from ..tokenizer import Tokenizer


class Tensor:
    """A tensor as its file stores it: `shape` (numpy order), `ggml_type` (an id of `ggml.py`), `data`
    (its bytes, a read-only uint8 view of the mapped file) and `row_order`, set when a load-time fix-up
    moves rows (row i of the tensor is stored row row_order[i]). Its value is float32:
    `np.asarray(t)`, `t.float32()`, or `t.rows(n0, n1)` for a few rows at a time."""

    dtype = np.dtype(np.float32)  # the dtype of its value (the storage type is `ggml_type`)

    def __init__(self, data: np.ndarray, ggml_type: int, shape: tuple[int, ...],
                 row_order: np.ndarray | None = None, release: Callable[..., None] | None = None):
        self.data, self.ggml_type, self.shape = data, ggml_type, tuple(shape)
        self.row_order = row_order
        self._release = release  # release(lo=0, hi=None): bytes lo..hi of `data` are no longer needed

    @classmethod
    def of(cls, a) -> "Tensor":
        """A float32 array as an F32 tensor (a checkpoint built in memory)."""
        a = np.ascontiguousarray(a, np.float32)
        return cls(a.reshape(-1).view(np.uint8), F32, a.shape)

    def plus(self, offset: float) -> "Tensor":
        """A new F32 tensor of float32(offset + value), element by element (one IEEE float32 addition
        each, as Gemma's RMSNorm computes its scale `1.0 + weight.float()`): the canonical value of a
        tensor its file stores offset (`arch.TensorSpec.hf_offset`). The file's bytes are released."""
        a = np.float32(offset) + self.float32()
        self.release()
        return Tensor.of(a)

    def row_slice(self, r0: int, r1: int) -> "Tensor":
        """Rows r0..r1 of a 2-D tensor as a Tensor of its own, without copying: a view of the stored
        bytes, in the stored type (a GGUF or safetensors matrix keeps its rows contiguous, and a
        quantized row is whole blocks), whose `release` lets go of those rows' bytes only. The parts of
        a fused matrix (`arch.TensorSpec.fused`: Phi-3's qkv_proj) are such slices."""
        if self.ndim != 2 or not 0 <= r0 < r1 <= self.shape[0]:
            raise ValueError(f"rows {r0}..{r1} of a tensor of shape {self.shape}")
        if self.row_order is not None:  # no converter writes a fused matrix whose rows also move
            raise ValueError("row_slice of a tensor whose rows move at load")
        rb = row_bytes(self.ggml_type, self.shape[1])
        if self.data.ndim != 1 or self.data.shape[0] != self.shape[0] * rb:
            raise ValueError(f"{self!r}: {self.data.shape} stored bytes are not {self.shape[0]} rows of {rb}")
        lo0, n = r0 * rb, (r1 - r0) * rb
        whole = self._release

        def release(lo=0, hi=None):  # offsets within the slice -> within the whole tensor
            whole(lo0 + lo, lo0 + (n if hi is None else hi))

        return Tensor(self.data[lo0:lo0 + n], self.ggml_type, (r1 - r0, self.shape[1]), None,
                      release if whole is not None else None)

    def expert(self, e: int, transposed: bool = False, interleave: int | None = None) -> "Tensor":
        """Expert e of a tensor stacked over experts ([experts, rows, cols]: GGUF's ffn_*_exps; or
        [experts, n]: their biases) as a Tensor of its own: a view of its bytes, as `row_slice` gives.
        `transposed` (its matrix stored [in, out]) and `interleave` (0 or 1: the even or odd rows of
        the matrix, elements of the vector) describe Hugging Face's gpt-oss layout: that expert's
        value is then computed when first asked for (`Derived`)."""
        if self.ndim not in (2, 3) or not 0 <= e < self.shape[0]:
            raise ValueError(f"expert {e} of a tensor of shape {self.shape}")
        n, k = self.shape[1:] if self.ndim == 3 else (1, self.shape[1])
        flat = Tensor(self.data, self.ggml_type, (self.shape[0] * n, k), self.row_order, self._release)
        one = flat.row_slice(e * n, (e + 1) * n)
        if self.ndim == 2:
            one.shape = (k,)
        if not transposed and interleave is None:
            return one

        def value():
            a = one.float32()
            a = a.T if transposed else a
            return np.ascontiguousarray(a if interleave is None else a[interleave::2])

        shape = one.shape[::-1] if transposed else one.shape
        if interleave is not None:
            shape = (shape[0] // 2,) + shape[1:]
        return Derived(value, shape, one.release)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    def float32(self) -> np.ndarray:
        """A new C-contiguous float32 array: the stored values dequantized exactly, rows in order."""
        w = dequantize(self.data, self.ggml_type, self.shape)
        return w if self.row_order is None else np.ascontiguousarray(w[self.row_order])

    def __array__(self, dtype=None, copy=None):
        a = self.float32()
        return a if dtype is None else a.astype(dtype)

    def rows(self, n0: int, n1: int) -> np.ndarray:
        """Rows n0..n1 of a 2-D tensor as float32 (only those rows are read, unless rows move)."""
        if self.row_order is not None:  # permuted Q/K rows: small matrices, read whole
            return self.float32()[n0:n1]
        rb = row_bytes(self.ggml_type, self.shape[1])
        raw = self.data.reshape(self.shape[0], rb)[n0:n1]
        return dequantize(raw, self.ggml_type, (n1 - n0, self.shape[1]))

    def release(self, rows: tuple[int, int] | None = None) -> None:
        """The bytes (of rows n0..n1, default all) have been copied out: let the file's pages go."""
        if self._release is None:
            return
        if rows is None:
            self._release()
        else:
            rb = self.data.shape[0] // self.shape[0]
            self._release(rows[0] * rb, rows[1] * rb)

    def __repr__(self) -> str:
        return f"Tensor({self.type_name}, {self.shape}{', rows moved' if self.row_order is not None else ''})"


class Derived(Tensor):
    """A tensor computed from a file's when first asked for (`Tensor.expert`'s gpt-oss layout, F32;
    `hf_mxfp4`'s blocks), and forgotten, with the file's bytes it came from, on `release`."""

    def __init__(self, value: Callable[[], np.ndarray], shape: tuple[int, ...], release_source: Callable[[], None],
                 ggml_type: int = F32):
        super().__init__(None, ggml_type, shape)
        self._value, self._source, self._data = value, release_source, None

    @property
    def data(self):
        if self._data is None:
            self._data = self._value().reshape(-1).view(np.uint8)
        return self._data

    @data.setter
    def data(self, v):
        self._data = v

    def release(self, rows=None) -> None:
        if rows is None:
            self._data = None
            self._source()


@dataclass
class Checkpoint:
    """A model as read from its file(s)."""

    config: ModelConfig
    tensors: dict[str, Tensor]  # canonical name -> tensor; a tied output is the embedding's object
    tokenizer: Tokenizer
    metadata: dict  # the file's own metadata (GGUF keys but the vocabulary; HF's config.json, ...)
    path: Path
    arch: ArchSpec
    format: str  # "gguf" or "huggingface"
    stored: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)  # (file name, type, shape)
