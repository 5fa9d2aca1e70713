"""Sampling: a pure function of (logits, settings, seed, position).

Random numbers come from a counter-based generator keyed by (seed, position) — SplitMix64's finalizer
over integers, so no state is shared between requests and every machine draws the same numbers.
Temperature 0 is argmax with ties to the lower id. Otherwise, in this order (as HF transformers):
temperature, top-k, top-p, min-p, then one draw. Probabilities use tinydet's own exp in float64 and sums
run left to right over the candidates sorted by logit (stable, ties to the lower id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from .errors import TinydetError
from .backends.cpu.mathfn import exp64

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A float64 in [0, 1) that depends only on (seed, position)."""
    h = _mix64((_mix64(seed & _M64) + (position + 1) * _GOLDEN) & _M64)
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise TinydetError(f"temperature: expected a finite number >= 0, found {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise TinydetError(f"top_k: expected an integer >= 0 (0 = off), found {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise TinydetError(f"top_p: expected a number in (0, 1], found {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise TinydetError(f"min_p: expected a number in [0, 1], found {self.min_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise TinydetError(f"seed: expected an integer >= 0, found {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@njit(cache=True)
def _argmax(logits):
    best = 0
    for i in range(1, logits.shape[0]):
        if logits[i] > logits[best]:  # strict: ties keep the lower id
            best = i
    return best


@njit(cache=True)
def _draw(sorted_logits, temperature, top_k, top_p, min_p, u):
    """Index into `sorted_logits` (descending) of the drawn token."""
    n = sorted_logits.shape[0]
    if top_k > 0 and top_k < n:
        n = top_k
    top = np.float64(sorted_logits[0])
    p = np.empty(n)
    total = 0.0
    for i in range(n):
        p[i] = exp64((np.float64(sorted_logits[i]) - top) / temperature)
        total += p[i]
    if top_p < 1.0:
        cum = 0.0
        for i in range(n):
            cum += p[i]
            if cum >= top_p * total:
                n = i + 1
                break
    if min_p > 0.0:
        # p[0] is the largest probability (exp(0) = 1 before normalization).
        for i in range(1, n):
            if p[i] < min_p * p[0]:
                n = i
                break
    kept = 0.0
    for i in range(n):
        kept += p[i]
    target = u * kept
    cum = 0.0
    for i in range(n):
        cum += p[i]
        if cum > target:
            return i
    return n - 1


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token id chosen from one float32 logits row for the token at `position`."""
    row = np.ascontiguousarray(logits, np.float32)
    if np.isnan(row).any():
        raise TinydetError("logits contain NaN: the model produced invalid values")
    if params.greedy:
        return int(_argmax(row))
    order = np.argsort(-row, kind="stable")  # comparisons only: exact on every machine
    i = _draw(row[order], params.temperature, params.top_k, params.top_p, params.min_p,
              uniform(params.seed, position))
    return int(order[i])
