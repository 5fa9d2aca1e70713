"""Errors that users see: one line naming the file, the field and what was expected."""

from __future__ import annotations


class TinydetError(Exception):
    """Base class for every error tinydet raises on bad input."""


class ModelFormatError(TinydetError):
    """A model file is missing, malformed or uses something tinydet does not support."""

    def __init__(self, path, field: str, message: str):
        self.path = str(path)
        self.field = field
        # A field named by the file (a tensor name, a key) may hold a newline or other control
        # characters: shown escaped, so the message stays one line.
        shown = field if field.isprintable() else field.encode("unicode_escape").decode("ascii")
        super().__init__(f"{self.path}: {shown}: {message}")


class ContextLengthError(TinydetError):
    """A request does not fit in the model's context window."""


class MemoryLimitError(TinydetError):
    """A load would need more memory than the machine (or the GPU) has available."""
