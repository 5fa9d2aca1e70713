"""RoPE's inverse frequencies for a `config.RoPE`, computed the same way on every machine (tinydet's
own exp/log, then + - * / only), and Llama 3's per-frequency factors.

Llama 3.1 scaling divides each frequency by a factor: `factor` for long wavelengths, 1 for short ones,
a blend between (transformers' `_compute_llama3_parameters`). llama.cpp's converter stores those
divisors in the GGUF as the tensor `rope_freqs.weight`, computed in float32 by torch; `llama3_factors`
computes them as that code does, operation for operation in float32 (torch evaluates `scalar / t` as
`reciprocal(t) * scalar`), with the one transcendental, base ** (2i / d), from tinydet's own exp/log
rounded once. So a Hugging Face directory and the GGUF llama.cpp makes of it give the same divisors
(checked against the converter's code for the Llama 3.1 and 3.2 configs in tests/test_llama3.py) and
hence the same bits. torch's float32 pow is not correctly rounded, so for a few other (base, head_dim)
pairs a stored divisor can differ in its last bit from this computation: `from_factors` then keeps the
file's divisors as they are (scaling "factors"), so the GGUF still runs exactly what it stores.
"""

from __future__ import annotations

import math

import numpy as np

from .config import RoPE

_f32 = np.float32
# Llama 3.x's blend bounds (every published Llama 3.1/3.2/3.3 config uses these two).
LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR = 1.0, 4.0


def _base_inv(base: float, head_dim: int) -> np.ndarray:
    """base ** (-2i / head_dim) in float64, from tinydet's own exp/log."""
    from .numerics.mathfn import exp64, log64  # here: reading a file's config needs no numba

    ln_base = log64(base)
    return np.array([exp64(-(2.0 * i / head_dim) * ln_base) for i in range(head_dim // 2)])


def _rdiv(a: float, t: np.float32) -> np.float32:
    """torch's `a / t` for a Python number a and a float32 tensor t: reciprocal(t) * a, in float32."""
    return _f32(_f32(_f32(1.0) / t) * _f32(a))


def llama3_factors(rope: RoPE, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) float32 divisors of a "llama3" RoPE's frequencies, as llama.cpp's converter
    computes them (its `LlamaModel.generate_extra_tensors`; module docstring)."""
    from .numerics.mathfn import exp64, log64

    ln_base = log64(rope.base)
    L, lo, hi = rope.original_context, rope.low_freq_factor, rope.high_freq_factor
    out = np.empty(head_dim // 2, np.float32)
    for i in range(head_dim // 2):
        x = _f32(_f32(2 * i) / _f32(head_dim))  # torch.arange(0, dim, 2, float32) / dim
        freq = _rdiv(1.0, _f32(exp64(float(x) * ln_base)))  # 1.0 / (base ** x)
        wavelen = _rdiv(2 * math.pi, freq)
        if wavelen < L / hi:
            out[i] = 1.0
        elif wavelen > L / lo:
            out[i] = rope.factor
        else:
            smooth = _f32(_f32(_rdiv(L, wavelen) - _f32(lo)) / _f32(hi - lo))
            out[i] = _rdiv(1.0, _f32(_f32(_f32(_f32(1.0) - smooth) / _f32(rope.factor)) + smooth))
    return out


def inv_freq(rope: RoPE, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) float64 inverse frequencies: base ** (-2i / head_dim), then the scaling:
    "linear" divides every one by `factor`, "llama3" and "factors" each by its own divisor."""
    inv = _base_inv(rope.base, head_dim)
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        return inv / llama3_factors(rope, head_dim).astype(np.float64)
    if rope.scaling == "factors":
        return inv / np.array(rope.freq_factors, np.float64)
    if rope.scaling == "yarn":
        return _yarn(rope, head_dim, inv)
    return inv


def _yarn(rope: RoPE, head_dim: int, inv: np.ndarray) -> np.ndarray:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`), in float64 with tinydet's log."""
    from .numerics.mathfn import log64

    def dim_of(rotations):  # the dimension whose wavelength makes `rotations` turns in the original context
        return head_dim * log64(rope.original_context / (rotations * 2 * math.pi)) / (2 * log64(rope.base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # the share of the unscaled frequency
    return inv / rope.factor * (1.0 - extrapolation) + inv * extrapolation


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default factor on cos and sin: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    from .numerics.mathfn import log64

    return 1.0 if factor <= 1 else 0.1 * log64(factor) + 1.0


def from_factors(base: float, head_dim: int, factors: np.ndarray) -> RoPE:
    """The RoPE of a GGUF's `rope_freqs.weight`: Llama 3's scaling with the parameters that give
    exactly these divisors where there are such (so the config reads as the Hugging Face one, and
    converts back to it), else the divisors as stored (scaling "factors")."""
    f = np.asarray(factors, np.float32)
    exact = RoPE(base, "factors", freq_factors=tuple(float(x) for x in f))
    if np.all(f == 1.0):
        return RoPE(base)
    factor = float(f.max())
    wavelens = 2 * math.pi / _base_inv(base, head_dim)
    # original_context L: each blended divisor gives it (smooth = (L / wavelen - lo) / (hi - lo)); with
    # none blended, any L between the last unscaled and the first fully scaled wavelength will do.
    band = [i for i in range(len(f)) if 1.0 < f[i] < factor]
    if band:
        guesses = set()
        for i in band:
            smooth = (1.0 / f[i] - 1.0 / factor) / (1.0 - 1.0 / factor)
            guesses.add(round(wavelens[i] * (smooth * (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR) + LOW_FREQ_FACTOR)))
    else:
        below = [w for w, x in zip(wavelens, f) if x == 1.0]
        above = [w for w, x in zip(wavelens, f) if x == factor]
        lo_L = max(below, default=0.0) * HIGH_FREQ_FACTOR  # L / hi must exceed every unscaled wavelength
        hi_L = min(above, default=math.inf) * LOW_FREQ_FACTOR  # L / lo must stay below every scaled one
        guesses = {2 ** k for k in range(1, 40) if lo_L < 2 ** k < hi_L}
    for L in sorted(guesses):
        if L <= 0:
            continue
        cand = RoPE(base, "llama3", factor, LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, int(L))
        if np.array_equal(llama3_factors(cand, head_dim).view(np.uint32), f.view(np.uint32)):
            return cand
    return exact
