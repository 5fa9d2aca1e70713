"""MXFP4 expert weights as the hub's gpt-oss checkpoints store them (config.json quantization_config
{"quant_method": "mxfp4"}), read as GGML MXFP4 blocks: the same values, so native storage keeps them
as blocks and every dtype sees the values transformers decodes (`convert_moe_packed_tensors`).

A matrix stacked over experts is two U8 tensors: `{name}_blocks` [experts, out, in / 32, 16], two FP4
(E2M1) codes a byte, the lower nibble the earlier element, and `{name}_scales` [experts, out, in / 32],
each block's exponent e for a factor 2^(e - 127). Unlike the float form, the matrix is [out, in], not
transposed. GGML's block_mxfp4 is the exponent byte (the same E8M0 value: ggml computes its codes'
doubled values times 2^(e - 128)) and 16 bytes whose lower nibbles are elements 0..15 and upper
nibbles 16..31, the codes themselves unchanged: converting moves nibbles only, as llama.cpp's
converter does (`transform_nibble_layout`)."""

from __future__ import annotations

import numpy as np

from ..errors import ModelFormatError
from .checkpoint import Derived, Tensor
from .ggml import MXFP4

BLOCK = 32


def is_mxfp4(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def ggml_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hub blocks [..., n_blocks, 16] and scales [..., n_blocks] -> GGML block_mxfp4 bytes [..., n_blocks
    * 17]."""
    lo, hi = blocks & 0x0F, blocks >> 4
    el = np.empty(blocks.shape[:-1] + (BLOCK,), np.uint8)  # the codes in element order
    el[..., 0::2], el[..., 1::2] = lo, hi
    out = np.empty(blocks.shape[:-1] + (17,), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = el[..., :16] | (el[..., 16:] << 4)
    return out.reshape(blocks.shape[:-2] + (-1,))


class MXFP4Stack(Tensor):
    """A stacked expert matrix of the hub's MXFP4 form, [experts, out, in]: each expert (`expert`) is
    converted to GGML MXFP4 rows when first asked for, the file's bytes let go when it is released."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray, shape: tuple[int, int, int], release):
        super().__init__(np.empty(0, np.uint8), MXFP4, shape, release=lambda lo=0, hi=None: release())
        self.blocks, self.scales = blocks, scales

    def expert(self, e: int, transposed: bool = False, interleave: int | None = None) -> Tensor:
        E, n, k = self.shape  # `transposed` is the float form's; these blocks are [out, in]
        if not 0 <= e < E:
            raise ValueError(f"expert {e} of a tensor of shape {self.shape}")
        rows = slice(None) if interleave is None else slice(interleave, None, 2)
        b = self.blocks.reshape(E, n, k // BLOCK, 16)
        s = self.scales.reshape(E, n, k // BLOCK)

        def value():
            return ggml_blocks(b[e, rows], s[e, rows])

        return Derived(value, ((n if interleave is None else n // 2), k), self._release, MXFP4)


def mxfp4_stack(f, name: str, want: tuple[int, ...], transposed: bool) -> MXFP4Stack:
    """The expert matrix `name` of safetensors file `f` from its `_blocks` and `_scales`; `want` its
    float form's shape (transposed: [experts, in, out])."""
    E, n, k = (want[0], want[2], want[1]) if transposed else want
    if k % BLOCK:
        raise ModelFormatError(f.path, name + "_blocks", f"MXFP4 needs inputs in blocks of {BLOCK}, found {k}")
    parts = {}
    for part, shape in (("_blocks", (E, n, k // BLOCK, 16)), ("_scales", (E, n, k // BLOCK))):
        st = f.tensors[name + part]
        if st.shape != shape:
            raise ModelFormatError(f.path, name + part, f"expected shape {shape} from config.json, found {st.shape}")
        parts[part] = f.raw(name + part, "U8")
    (blocks, rb), (scales, rs) = parts["_blocks"], parts["_scales"]

    def release():
        rb()
        rs()

    return MXFP4Stack(blocks, scales, (E, n, k), release)
