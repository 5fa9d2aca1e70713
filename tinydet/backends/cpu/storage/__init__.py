"""The CPU kernels' storage kinds: one module per kind (or family of kinds), each implementing the
interface of `loaders.py` for its storage; `kinds.py` the tags that name them, `table.py` the one table
kind -> module."""
