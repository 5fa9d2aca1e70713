"""tinydet: a deterministic transformer inference runtime."""

__version__ = "0.1.0"
