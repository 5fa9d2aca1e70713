"""Gemma 2: Gemma 3's layout without QK-norm, and with attention logit soft-capping. A norm after
attention and after the FFN besides the ones before them, a GELU-tanh gated FFN, the embedding scaled
by sqrt(dim) (a float32), tied output, a head_dim of its own, one RoPE for every layer, sliding-window
layers alternating with global ones (layers 0, 2, 4, ... slide), every attention score (q.k times the
scale) soft-capped to cap * tanh(score / cap) before the softmax (ModelConfig.attn_softcap), and the
final logits soft-capped too.

GGUF (llama.cpp's gemma2): the norm weights are stored as (1 + w), what the kernels multiply by, and
Q/K rows as HF has them (NEOX RoPE: nothing permuted). Read as llama.cpp's loader reads the keys:
`attention.sliding_window` (default 4096; positive), the even layers sliding (llama.cpp's fixed
pattern of 2), `attn_logit_softcapping` (default 50) and `final_logit_softcapping` (default 30), both
applied always; `rope.freq_base` (default 10000; the converter writes none); the attention scale
1/sqrt(query_pre_attn_scalar), that scalar being head_dim except in the 27B model (46 layers), where
it is dim / heads, as llama.cpp fixes it.

Hugging Face (Gemma2ForCausalLM, model_type gemma2), read as transformers' Gemma2Config reads
config.json, with its defaults where a key is absent: layer_types (else the even layers sliding),
sliding_window (default 4096; null refused where layers slide), attn_logit_softcapping (default 50)
and final_logit_softcapping (default 30), each null for none, query_pre_attn_scalar (default 256; the
scale is float32(s ** -0.5)), head_dim (default 256), rope_theta (default 10000, no scaling);
hidden_activation must be gelu_pytorch_tanh, use_bidirectional_attention off; tie_word_embeddings
defaults to true. HF stores every norm weight as w and scales by float32(1 + w) (Gemma2RMSNorm), read
and written as Gemma 3's are (`gemma3`: hf_offset=1.0, and when converting back exact for every stored
value in [0.5, 2**24]). A window at least as long as the context slides nothing, in both formats.
"""

from __future__ import annotations

import math

import numpy as np

from . import ArchSpec
from .gemma3 import TENSORS as GEMMA3_TENSORS
from .gemma3 import query_pre_attn_scalar
from ..errors import TinydetError

PATTERN = 2  # every PATTERN-th layer attends globally (llama.cpp's set_swa_pattern(2), Gemma2Config)
WINDOW = 4096  # llama.cpp's and Gemma2Config's sliding window when the file has none
ATTN_CAP, FINAL_CAP = 50.0, 30.0  # llama.cpp's and Gemma2Config's soft caps when the file has none

TENSORS = tuple(t for t in GEMMA3_TENSORS if t.canonical not in ("layers.{}.q_norm", "layers.{}.k_norm"))


def _sliding(n: int) -> list[bool]:
    return [i % PATTERN < PATTERN - 1 for i in range(n)]


def _common(fields: dict, windows, attn_cap, final_cap, scalar) -> dict:
    return {**fields, "layer_windows": tuple(windows), "attn_scale": float(np.float32(scalar ** -0.5)),
            "embed_scale": float(np.float32(fields["dim"] ** 0.5)), "attn_softcap": attn_cap,
            "logit_softcap": final_cap}


def _gguf_config(k, fields: dict) -> dict:
    """As llama.cpp's gemma2 loader reads the keys (module docstring)."""
    n = fields["n_layers"]
    window = k.int("attention.sliding_window", WINDOW)
    if window <= 0:
        k.bad("attention.sliding_window", f"expected a positive window, found {window!r}")
    caps = []
    for key, default in (("attn_logit_softcapping", ATTN_CAP), ("final_logit_softcapping", FINAL_CAP)):
        cap = k.float(key, default)
        if not 0 < cap < math.inf:  # NaN, 0 or inf would make every score or logit NaN or 0
            k.bad(key, f"expected a positive number, found {cap!r}")
        caps.append(cap)
    scalar = fields["dim"] // fields["n_heads"] if n == 46 else fields["head_dim"]  # llama.cpp's rule (46: 27B)
    return _common(fields, (window if s else 0 for s in _sliding(n)), caps[0], caps[1], scalar)


def _hf_config(f, fields: dict) -> dict:
    """config.json as transformers' Gemma2Config reads it (module docstring)."""
    c, n = f.c, fields["n_layers"]
    f.tie_default = True  # Gemma2Config's tie_word_embeddings
    act = f.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        f.bad("hidden_activation", f"activation {act!r} is not supported (supported: 'gelu_pytorch_tanh')")
    if c.get("use_bidirectional_attention"):
        f.bad("use_bidirectional_attention", "bidirectional attention is not supported")
    caps = []
    for key, default in (("attn_logit_softcapping", ATTN_CAP), ("final_logit_softcapping", FINAL_CAP)):
        cap = default if key not in c else None if c[key] is None else f.float(key)
        if cap is not None and cap <= 0:
            f.bad(key, f"expected a positive number or null, found {cap!r}")
        caps.append(cap)
    scalar = f.float("query_pre_attn_scalar", 256.0)
    if scalar <= 0:
        f.bad("query_pre_attn_scalar", f"expected a positive number, found {scalar!r}")
    head_dim = fields["head_dim"] if c.get("head_dim") is not None else 256  # Gemma2Config's default

    types = f.layer_types(n, lambda: ["sliding_attention" if s else "full_attention" for s in _sliding(n)])
    window = 0
    if "sliding_attention" in types:
        if "sliding_window" in c and c["sliding_window"] is None:
            f.bad("sliding_window", "null, but layer_types has sliding layers")
        window = f.int("sliding_window", WINDOW)
    return _common({**fields, "head_dim": head_dim}, (window if t == "sliding_attention" else 0 for t in types),
                   caps[0], caps[1], scalar)


def _hf_out(cfg) -> dict:
    """config.json's Gemma 2 keys for a config read from a GGUF (convert), in the hub's 4.x form."""
    n = cfg.n_layers
    windows = sorted({cfg.window(i) for i in range(n)} - {0})
    if len(windows) > 1 or cfg.layer_ropes:
        raise TinydetError(f"gemma2: config.json cannot say these layer windows and RoPEs ({cfg.layer_windows}, "
                           f"{cfg.layer_ropes})")
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": query_pre_attn_scalar(cfg),
            "sliding_window": windows[0] if windows else None,
            "layer_types": ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(n)],
            "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.logit_softcap,
            "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False}


SPEC = ArchSpec(
    name="gemma2",
    gguf_arch="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    hf_model_type="gemma2",
    tensors=TENSORS,
    flags={"post_norms": True, "activation": "gelu_tanh"},
    own_head_dim=True,
    hf_activations=("gelu_pytorch_tanh",),  # config.json's hidden_act (Gemma's own key: hidden_activation)
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
