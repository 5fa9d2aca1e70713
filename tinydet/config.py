"""Model configuration: a frozen dataclass built from a file's own metadata."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFormatError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class Config:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def validate(self, path, keys: dict[str, str] | None = None) -> "Config":
        """Check the values make a runnable model; `keys` names each field as the file spells it."""
        def bad(field, msg):
            raise ModelFormatError(path, (keys or {}).get(field, field), msg)

        for name in ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                bad(name, f"expected a positive integer, found {v!r}")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"{self.n_kv_heads} KV heads do not divide {self.n_heads} query heads")
        if self.head_dim % 2:
            bad("head_dim", f"RoPE needs an even head dimension, found {self.head_dim}")
        if not self.rope_base > 0:
            bad("rope_base", f"expected a positive RoPE base, found {self.rope_base!r}")
        if not 0 < self.rms_eps < 1:
            bad("rms_eps", f"expected an RMSNorm epsilon in (0, 1), found {self.rms_eps!r}")
        return self


def config_from_gguf(gguf) -> Config:
    """Build a Config from `{arch}.*` keys, with llama.cpp's defaults where a key is absent."""
    path: Path = gguf.path
    arch = gguf.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(path, "general.architecture",
                               f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def req_int(key):
        v = gguf.require(f"{arch}.{key}")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelFormatError(path, f"{arch}.{key}", f"expected an integer, found {v!r}")
        return v

    dim = req_int("embedding_length")
    n_heads = req_int("attention.head_count")
    n_kv = gguf.get(f"{arch}.attention.head_count_kv", n_heads)
    if n_heads <= 0 or dim % n_heads:
        raise ModelFormatError(path, f"{arch}.attention.head_count",
                               f"{n_heads} heads do not divide embedding_length {dim}")
    head_dim = dim // n_heads
    key_len = gguf.get(f"{arch}.attention.key_length", head_dim)
    if key_len != head_dim:
        raise ModelFormatError(path, f"{arch}.attention.key_length",
                               f"expected embedding_length / head_count = {head_dim}, found {key_len}")
    rope_dim = gguf.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelFormatError(path, f"{arch}.rope.dimension_count",
                               f"partial RoPE is not supported: expected {head_dim}, found {rope_dim}")
    if gguf.get(f"{arch}.rope.scaling.type", "none") not in ("none",):
        raise ModelFormatError(path, f"{arch}.rope.scaling.type",
                               f"RoPE scaling {gguf.get(f'{arch}.rope.scaling.type')!r} is not supported")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size")
    if vocab is None:
        if "token_embd.weight" in gguf.tensors:
            vocab = gguf.tensors["token_embd.weight"].shape[0]
        elif tokens is not None:
            vocab = len(tokens)
        else:
            raise ModelFormatError(path, f"{arch}.vocab_size", "missing, and no token_embd.weight to infer it from")
    cfg = Config(
        arch=arch,
        n_layers=req_int("block_count"),
        dim=dim,
        ffn_dim=req_int("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=int(vocab),
        context_length=req_int("context_length"),
        rope_base=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(gguf.require(f"{arch}.attention.layer_norm_rms_epsilon")),
    )
    return cfg.validate(path, {
        "n_layers": f"{arch}.block_count", "dim": f"{arch}.embedding_length",
        "ffn_dim": f"{arch}.feed_forward_length", "n_heads": f"{arch}.attention.head_count",
        "n_kv_heads": f"{arch}.attention.head_count_kv", "head_dim": f"{arch}.attention.head_count",
        "vocab_size": f"{arch}.vocab_size", "context_length": f"{arch}.context_length",
        "rope_base": f"{arch}.rope.freq_base", "rms_eps": f"{arch}.attention.layer_norm_rms_epsilon",
    })
