"""Log-probabilities from float32 logits rows, with the same bits on every machine.

log p(i) = x_i - (m + log sum_j exp(x_j - m)), m = max x, in float64 with tinydet's own exp and log
(NumPy's and libm's vary with the CPU path; here 64 lanes at a time), the sum in an order fixed by the
vocabulary's size.
The top alternatives are ordered by logit, ties to the lower id, as the sampler orders them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .errors import TinydetError
from .numerics.mathfn import exp64, log64
from .numerics.simd import LANES, v_load
from .numerics.vmath import v_exp64_sum_sub

MAX_TOP = 20  # OpenAI's limit for top_logprobs


@njit(cache=True)
def _log_norm(row):
    """m + log sum exp(x - m) of one row: the sum over 64-lane blocks (each block's lanes in order),
    then the tail, left to right."""
    m = np.float64(row[0])
    for i in range(1, row.shape[0]):
        if row[i] > m:
            m = np.float64(row[i])
    n = row.shape[0]
    full = n - n % LANES
    s = 0.0
    for b in range(0, full, LANES):
        s += v_exp64_sum_sub(v_load(row, b), m)
    for i in range(full, n):
        s += exp64(np.float64(row[i]) - m)
    return m + log64(s)


@njit(cache=True)
def _top(row, k):
    """Ids of the k largest logits, largest first, ties to the lower id (insertion into a short list)."""
    ids = np.empty(k, np.int64)
    n = 0
    for i in range(row.shape[0]):
        x = row[i]
        if n == k and not x > row[ids[n - 1]]:
            continue
        j = n if n < k else k - 1
        while j > 0 and x > row[ids[j - 1]]:  # strict: an equal logit stays behind the lower id
            ids[j] = ids[j - 1]
            j -= 1
        ids[j] = i
        if n < k:
            n += 1
    return ids[:n]


def token_logprobs(row: np.ndarray, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """(log p(token), [(id, log p(id)) for the `top` most likely ids]) under one logits row."""
    x = np.ascontiguousarray(row, np.float32).reshape(-1)
    # -inf is a token a constraint ruled out (`structured.py`): probability 0, never an alternative
    if np.isnan(x).any() or (x == np.inf).any() or not np.isfinite(x[token]):
        raise TinydetError("logits contain NaN or infinity: the model produced invalid values")
    if not 0 <= top <= MAX_TOP:
        raise TinydetError(f"top_logprobs: expected 0 to {MAX_TOP}, found {top}")
    norm = _log_norm(x)
    alts = [(int(i), float(np.float64(x[i]) - norm)) for i in _top(x, top) if x[i] > -np.inf] if top else []
    return float(np.float64(x[token]) - norm), alts
