"""tinydet: a deterministic transformer inference runtime — the same bits every time."""

import os as _os
import sys as _sys

# numba sizes its thread pool once, at import; leave room for `threads` above the core count (the
# determinism checks run 1-4 threads on any machine). The active count is set per call.
if "numba" not in _sys.modules and "NUMBA_NUM_THREADS" not in _os.environ:
    _os.environ["NUMBA_NUM_THREADS"] = str(max(_os.cpu_count() or 1, 4))

__version__ = "0.1.0"

from .api import Model, load  # noqa: E402
from .errors import ContextLengthError, ModelFormatError, TinydetError  # noqa: E402
from .engine import Generation  # noqa: E402

__all__ = ["load", "Model", "Generation", "TinydetError", "ModelFormatError", "ContextLengthError", "__version__"]
