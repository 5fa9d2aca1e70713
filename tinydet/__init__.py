"""tinydet: a deterministic transformer inference runtime — the same bits every time."""

import os as _os
import sys as _sys

# numba sizes its thread pool once, at import; leave room for `threads` above the core count (the
# determinism checks run 1-4 threads on any machine). The active count is set per call.
if "numba" not in _sys.modules and "NUMBA_NUM_THREADS" not in _os.environ:
    _os.environ["NUMBA_NUM_THREADS"] = str(max(_os.cpu_count() or 1, 4))

__version__ = "0.1.0"

from .errors import ContextLengthError, ModelFormatError, TinydetError  # noqa: E402

# load, Model and Generation are imported on first use (PEP 562): they bring NumPy and numba (about a
# second), and the `tinydet` command sets up its Ctrl-C and SIGTERM handling before that (__main__.py).
_LAZY = {"load": ".api", "Model": ".api", "Generation": ".engine"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = globals()[name] = getattr(importlib.import_module(_LAZY[name], __name__), name)
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["load", "Model", "Generation", "TinydetError", "ModelFormatError", "ContextLengthError", "__version__"]
