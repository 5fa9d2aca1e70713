"""A model in a GGUF file -> Checkpoint: the config from `{arch}.*` keys (llama.cpp's names and
defaults), the tensors under canonical names through the architecture's spec, the tokenizer from the
`tokenizer.ggml.*` keys."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable

import numpy as np

from .. import arch as archs
from ..arch import short
from ..config import ModelConfig, RoPE, rope_refusal
from ..errors import ModelFormatError
from .checkpoint import Checkpoint, Tensor
from .gguf import GGUFFile

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")


def rope_row_order(n: int, n_heads: int) -> np.ndarray:
    """The rows of a Q or K matrix in HF's rotate-half order, from llama.cpp's converter's order.

    convert_hf_to_gguf moves each head's rows from HF's rotate-half order (i, i + hd/2) to adjacent
    pairs (2i, 2i+1) so that llama.cpp rotates neighbours; out[i] = stored[order[i]] moves them back.
    Rows only move: no value changes."""
    hd = n // n_heads
    return np.ascontiguousarray(np.arange(n).reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(n))


_REQUIRED = object()  # default of the _Keys readers: the key must be present


class _Keys:
    """Typed reads of `{arch}.*` keys; errors name the key."""

    def __init__(self, g: GGUFFile, arch: str):
        self.g, self.arch, self.path = g, arch, g.path

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def bad(self, name: str, msg: str):
        raise ModelFormatError(self.path, self.key(name), msg)

    def get(self, name: str, default=None):
        return self.g.get(self.key(name), default)

    def _read(self, name: str, default):
        return self.g.require(self.key(name)) if default is _REQUIRED else self.g.get(self.key(name), default)

    # A downloaded file may store any key as any GGUF type (an array, a string): each reader checks
    # the type, so a wrong one is refused here and not met later as a NumPy or Python TypeError.
    # `default=None` makes a key optional with None when absent.
    def int(self, name: str, default=_REQUIRED) -> int | None:
        v = self._read(name, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.bad(name, f"expected an integer, found {short(v)}")
        return v

    def float(self, name: str, default=_REQUIRED) -> float | None:
        v = self._read(name, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.bad(name, f"expected a number, found {short(v)}")
        return float(v)

    def str(self, name: str, default=_REQUIRED) -> str | None:
        v = self._read(name, default)
        if v is None and default is None:
            return None
        if not isinstance(v, str):
            self.bad(name, f"expected a string, found {short(v)}")
        return v


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (Llama 3.1's scaling)


def _rope_freqs(g: GGUFFile, spec: archs.ArchSpec, rope: RoPE, scaling: str, head_dim: int) -> RoPE:
    """The RoPE of a file with rope_freqs.weight: its divisors, as Llama 3's parameters where they
    reproduce them exactly (`rope.from_factors`)."""
    from ..rope import from_factors

    if "factors" not in spec.rope_scalings:
        raise ModelFormatError(g.path, ROPE_FREQS, f"per-frequency RoPE factors are not supported for {spec.name}")
    if scaling != "none":
        raise ModelFormatError(g.path, ROPE_FREQS, f"per-frequency RoPE factors together with RoPE scaling "
                                                   f"{scaling!r} are not supported")
    info = g.tensors[ROPE_FREQS]
    if info.shape != (head_dim // 2,) or info.type_name != "F32":
        raise ModelFormatError(g.path, ROPE_FREQS, f"expected F32 of shape ({head_dim // 2},) (head_dim / 2), found "
                                                   f"{info.type_name} of shape {info.shape}")
    f = np.frombuffer(g.tensor_bytes(ROPE_FREQS), np.float32)
    if not np.all(np.isfinite(f) & (f > 0)):
        raise ModelFormatError(g.path, ROPE_FREQS, "expected positive, finite factors")
    return from_factors(rope.base, head_dim, f)


def gguf_config(g: GGUFFile) -> tuple[archs.ArchSpec, ModelConfig]:
    """The architecture's spec and the Config from `{arch}.*` keys, with llama.cpp's defaults where a
    key is absent."""
    path: Path = g.path
    name = g.require("general.architecture")
    if not isinstance(name, str):
        raise ModelFormatError(path, "general.architecture", f"expected a string, found {short(name)}")
    spec = archs.by_gguf(name)
    if spec is None:
        supported = ", ".join(archs.gguf_archs())
        raise ModelFormatError(path, "general.architecture",
                               f"architecture {name!r} is not supported (supported: {supported})")
    k = _Keys(g, name)
    dim = k.int("embedding_length")
    n_heads = k.int("attention.head_count")
    n_kv = k.int("attention.head_count_kv", n_heads)
    key_len = k.int("attention.key_length", None)
    if n_heads <= 0 or (key_len is None or not spec.own_head_dim) and dim % n_heads:
        k.bad("attention.head_count", f"{n_heads} heads do not divide embedding_length {dim}")
    head_dim = dim // n_heads
    if key_len is not None:
        if spec.own_head_dim:
            head_dim = key_len
        elif key_len != head_dim:
            k.bad("attention.key_length", f"expected embedding_length / head_count = {head_dim}, found {key_len}")
    value_len = k.int("attention.value_length", head_dim)
    if value_len != head_dim:
        k.bad("attention.value_length", f"expected the key length {head_dim}, found {value_len}")
    rope_dim = k.int("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        k.bad("rope.dimension_count", f"partial RoPE is not supported: expected {head_dim}, found {rope_dim}")
    scaling = k.str("rope.scaling.type", "none")
    if scaling not in spec.rope_scalings or scaling == "yarn" and not spec.gguf_yarn:  # the spec's hook reads it
        k.bad("rope.scaling.type", f"RoPE scaling {scaling!r} is not supported{rope_refusal(scaling)}")
    rope = RoPE(base=k.float("rope.freq_base", 10000.0))
    # Checked here, not only by validate(): rope_freqs.weight below is turned into parameters from it.
    if not 0 < rope.base < math.inf:
        k.bad("rope.freq_base", f"expected a positive RoPE base, found {rope.base!r}")
    if scaling == "linear":
        rope = RoPE(base=rope.base, scaling="linear", factor=k.float("rope.scaling.factor", 1.0))
    if ROPE_FREQS in g.tensors:
        rope = _rope_freqs(g, spec, rope, scaling, head_dim)
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = k.int("vocab_size", None)
    if vocab is None:
        if "token_embd.weight" in g.tensors:
            vocab = g.tensors["token_embd.weight"].shape[0]
        elif isinstance(tokens, list):
            vocab = len(tokens)
        else:
            k.bad("vocab_size", "missing, and no token_embd.weight to infer it from")
    fields = dict(arch=spec.name, n_layers=k.int("block_count"), dim=dim, ffn_dim=k.int("feed_forward_length"),
                  n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=int(vocab),
                  context_length=k.int("context_length"), rope=rope,
                  rms_eps=k.float("attention.layer_norm_rms_epsilon"), **spec.flags)
    # Every layer has tensors of its own in the file: a larger block_count is refused here, before
    # the architecture's hook makes per-layer tables of that length.
    if not 0 < fields["n_layers"] <= len(g.tensors):
        k.bad("block_count", f"expected 1..{len(g.tensors)} layers (the file has {len(g.tensors)} tensors), "
                             f"found {fields['n_layers']}")
    if spec.gguf_config is not None:
        fields = spec.gguf_config(k, fields)
    a = name
    return spec, ModelConfig(**fields).validate(path, {
        "n_layers": f"{a}.block_count", "dim": f"{a}.embedding_length", "ffn_dim": f"{a}.feed_forward_length",
        "n_heads": f"{a}.attention.head_count", "n_kv_heads": f"{a}.attention.head_count_kv",
        "head_dim": f"{a}.attention.key_length" if key_len is not None else f"{a}.attention.head_count",
        "vocab_size": f"{a}.vocab_size", "context_length": f"{a}.context_length", "rope_base": f"{a}.rope.freq_base",
        "rms_eps": f"{a}.attention.layer_norm_rms_epsilon",
    })


def gguf_tensors(g: GGUFFile, spec: archs.ArchSpec, cfg: ModelConfig,
                 progress: Callable[[int, int, str], None] | None = None) -> dict[str, Tensor]:
    """Every tensor of the model under its canonical name, as the file stores it (rows of Q/K moved
    back to HF's order where the spec says the converter permuted them). An absent `output.weight`
    is tied to the embedding: the same Tensor object."""
    heads = {"q": cfg.n_heads, "k": cfg.n_kv_heads}

    def find(canon, gname, want, t):
        if gname not in g.tensors:
            if canon == archs.TIED[0]:
                return None  # tied
            raise ModelFormatError(g.path, gname, "required tensor is missing")
        info = g.tensors[gname]
        if info.shape != want:
            raise ModelFormatError(g.path, gname, f"expected shape {want} from the metadata, found {info.shape}")
        order = None
        if spec.gguf_rope_permuted and t.rope_rows is not None:
            order = rope_row_order(info.shape[0], heads[t.rope_rows])
        return Tensor(g.tensor_bytes(gname), info.ggml_type, info.shape, order, functools.partial(g.release, gname))

    return spec.gather(cfg, "gguf", find, progress)


def open_gguf(path: str | Path, progress: Callable[[int, int, str], None] | None = None) -> Checkpoint:
    """A GGUF model file -> Checkpoint (nothing is dequantized here)."""
    from ..tokenizer import Tokenizer

    g = GGUFFile(path)
    spec, cfg = gguf_config(g)
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata, g.path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelFormatError(g.path, "tokenizer.ggml.tokens",
                               f"{tokenizer.vocab_size} tokens but the model has a vocabulary of {cfg.vocab_size}")
    # The vocabulary arrays live on in the tokenizer: not twice in memory, also not while the
    # weights load (the tensors keep `g` until then).
    g.drop_metadata(TOKENIZER_ARRAYS)
    tensors = gguf_tensors(g, spec, cfg, progress)
    metadata = dict(g.metadata)
    stored = [(t.name, t.type_name, t.shape) for t in g.tensors.values()]
    return Checkpoint(cfg, tensors, tokenizer, metadata, g.path, spec, "gguf", stored)
