"""Run one input through a target in-process and classify what happened.

Outcomes: "ok" (it loaded and ran), "refused" (a TinydetError with a one-line message), and the
failures: "escape" (any other exception, or a TinydetError whose message is empty or spans lines),
"hang" (past the per-input time limit, by SIGALRM: campaign processes only, main thread), "alloc"
(tracemalloc's peak past a bound derived from the input's size: a file claiming a 2^40-element
tensor must be refused before anything that size is allocated)."""

from __future__ import annotations

import signal
import time
import traceback
import tracemalloc
from dataclasses import dataclass
from typing import Callable

from tinydet.errors import TinydetError

FAILURES = ("escape", "hang", "alloc")


class Hang(BaseException):
    """Raised by the alarm; a BaseException, so `except Exception` in the code under test lets it by."""


@dataclass
class Outcome:
    kind: str  # ok / refused / escape / hang / alloc
    detail: str = ""  # the refusal's message, or the exception's type, message and innermost frame
    seconds: float = 0.0
    peak: int = 0  # bytes, tracemalloc's peak while the target ran


def alloc_bound(input_size: int) -> int:
    """Memory a target may use for an input of `input_size` bytes: a loaded model holds its weights
    unpacked and repacked (float32 from quantized blocks is up to 8x), the tokenizer its vocabulary as
    Python objects (tens of bytes a token), plus the interpreter's fixed overhead."""
    return 64 * input_size + 64 * 2**20


def _alarm(signum, frame):
    raise Hang()


def run_one(fn: Callable[[], object], input_size: int, time_limit: float = 10.0, trace_memory: bool = True,
            use_alarm: bool = True) -> Outcome:
    """fn() runs the target on one input already written to disk."""
    t0 = time.perf_counter()
    old = None
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    if trace_memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
    kind, detail = "ok", ""
    try:
        fn()
    except Hang:
        kind, detail = "hang", f"still running after {time_limit} s"
    except TinydetError as e:
        msg = str(e)
        if not msg.strip() or "\n" in msg.strip():
            kind, detail = "escape", f"{type(e).__name__} without a one-line message: {msg!r}"
        else:
            kind, detail = "refused", msg
    except RecursionError as e:
        kind, detail = "escape", f"RecursionError: {e}"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001  (a Rust panic in `tokenizers` is a BaseException too)
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        kind, detail = "escape", f"{type(e).__name__}: {str(e)[:300]}{where}"
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        peak = 0
        if trace_memory:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    seconds = time.perf_counter() - t0
    if kind in ("ok", "refused") and peak > alloc_bound(input_size):
        kind, detail = "alloc", f"peak {peak} bytes for an input of {input_size} bytes ({detail[:200]})"
    return Outcome(kind, detail, seconds, peak)
