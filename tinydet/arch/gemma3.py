"""Gemma 3 (text): QK-norm, a norm after attention and after the FFN besides the ones before them, a
GELU-tanh gated FFN, the embedding scaled by sqrt(dim) (as a float32, as the reference computes it),
tied output, a head_dim of its own, and sliding-window layers: every layer but each `pattern`-th
attends to the last `window` positions and rotates with its own RoPE base.

GGUF (llama.cpp's gemma3): the norm weights are stored as (1 + w), which is what the kernels multiply
by. The file gives the window (`attention.sliding_window`; none or 0: no sliding layers), the layer
pattern (`attention.sliding_window_pattern`, default 6: layers 5, 11, 17, ... attend globally), the
global layers' RoPE (`rope.freq_base` and a linear `rope.scaling.factor`) and the sliding layers'
(`rope.freq_base_swa`, default 10000); llama.cpp fixes the rest for the architecture and so does this
spec: the attention scale 1/sqrt(query_pre_attn_scalar), that scalar being head_dim except in the 27B model
(62 layers), where it is dim / heads, and final logit soft-capping only where the file sets it.

Hugging Face (Gemma3ForCausalLM, model_type gemma3_text), read as transformers' Gemma3TextConfig reads
config.json, with its defaults where a key is absent: layer_types (else sliding_window_pattern, default
6) and sliding_window (default 4096, at most max_position_embeddings); the global layers' RoPE from
rope_theta (default 1e6) and rope_scaling (transformers 4.x: linear only, applied to the global layers
only) or rope_parameters.full_attention (5.x), the sliding layers' from rope_local_base_freq (default
10000) or rope_parameters.sliding_attention (unscaled); the attention scale
float32(query_pre_attn_scalar ** -0.5) (default 256), head_dim (default 256), final_logit_softcapping;
hidden_activation must be gelu_pytorch_tanh, attn_logit_softcapping unset, use_bidirectional_attention
off; tie_word_embeddings defaults to true. HF stores every norm weight as w and scales by float32(1 + w)
(Gemma3RMSNorm); the norms' TensorSpecs say so (hf_offset=1.0), so the reader gives the kernels that
float32(1 + w), as llama.cpp's converter stores it (it widens a bf16 checkpoint to float32 before
adding 1; only an fp16 one would be added in fp16). Converting a GGUF to HF writes w = float32(s - 1)
for a stored s, and reading that back gives float32(1 + w) = s exactly for every s in [0.5, 2**24]
(Sterbenz's lemma for s in [0.5, 2]; above, s and 1 are multiples of ulp(s) <= 1, so s - 1 is exact,
and so is 1 + (s - 1)); below 0.5, s - 1 may round and s may come back changed (s = 2**-30 comes
back 0)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import ArchSpec, TensorSpec, short
from ..config import RoPE
from ..errors import TinydetError
from .rope_params import per_layer_type, rope_object

PATTERN = 6  # every PATTERN-th layer attends to every position (llama.cpp's default for gemma3)
LOCAL_ROPE_BASE = 10000.0


def _T(canonical, gguf, hf, shape, **kw) -> TensorSpec:
    return TensorSpec(canonical, gguf, hf, shape, **kw)


_L = "model.layers.{}."
# Every norm: HF stores w, the model (and GGUF) scales by 1 + w.
TENSORS = (
    _T("tok_embeddings", "token_embd.weight", "model.embed_tokens.weight", ("vocab_size", "dim")),
    _T("norm", "output_norm.weight", "model.norm.weight", ("dim",), hf_offset=1.0),
    _T("output", "output.weight", "lm_head.weight", ("vocab_size", "dim")),  # absent: tied (always, in Gemma 3)
    _T("layers.{}.attention_norm", "blk.{}.attn_norm.weight", _L + "input_layernorm.weight", ("dim",), hf_offset=1.0),
    _T("layers.{}.wq", "blk.{}.attn_q.weight", _L + "self_attn.q_proj.weight", ("q_dim", "dim")),
    _T("layers.{}.wk", "blk.{}.attn_k.weight", _L + "self_attn.k_proj.weight", ("kv_dim", "dim")),
    _T("layers.{}.wv", "blk.{}.attn_v.weight", _L + "self_attn.v_proj.weight", ("kv_dim", "dim")),
    _T("layers.{}.q_norm", "blk.{}.attn_q_norm.weight", _L + "self_attn.q_norm.weight", ("head_dim",), hf_offset=1.0),
    _T("layers.{}.k_norm", "blk.{}.attn_k_norm.weight", _L + "self_attn.k_norm.weight", ("head_dim",), hf_offset=1.0),
    _T("layers.{}.wo", "blk.{}.attn_output.weight", _L + "self_attn.o_proj.weight", ("dim", "q_dim")),
    _T("layers.{}.post_attention_norm", "blk.{}.post_attention_norm.weight", _L + "post_attention_layernorm.weight",
       ("dim",), hf_offset=1.0),
    _T("layers.{}.ffn_norm", "blk.{}.ffn_norm.weight", _L + "pre_feedforward_layernorm.weight", ("dim",),
       hf_offset=1.0),
    _T("layers.{}.w1", "blk.{}.ffn_gate.weight", _L + "mlp.gate_proj.weight", ("ffn_dim", "dim")),
    _T("layers.{}.w2", "blk.{}.ffn_down.weight", _L + "mlp.down_proj.weight", ("dim", "ffn_dim")),
    _T("layers.{}.w3", "blk.{}.ffn_up.weight", _L + "mlp.up_proj.weight", ("ffn_dim", "dim")),
    _T("layers.{}.post_ffn_norm", "blk.{}.post_ffw_norm.weight", _L + "post_feedforward_layernorm.weight", ("dim",),
       hf_offset=1.0),
)


def _gguf_config(k, fields: dict) -> dict:
    """As llama.cpp's gemma3 loader reads the keys: a missing or zero sliding_window means no sliding
    layers; sliding_window_pattern is a period (default 6) or one flag per layer; the sliding layers
    rotate with rope.freq_base_swa (default 10000), unscaled."""
    n, ctx = fields["n_layers"], fields["context_length"]
    window = k.int("attention.sliding_window", 0)
    if not 0 <= window <= ctx:
        k.bad("attention.sliding_window", f"expected a window in 0..context_length ({ctx}), found {window!r}")
    sliding = [False] * n
    if window:
        pattern = k.get("attention.sliding_window_pattern", PATTERN)
        if isinstance(pattern, np.ndarray):  # the reader gives a numeric or bool array as an ndarray
            if pattern.shape != (n,) or pattern.dtype.kind not in "biu":
                k.bad("attention.sliding_window_pattern", f"expected {n} per-layer flags, found {short(pattern)}")
            sliding = [bool(x) for x in pattern.tolist()]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            sliding = [i % pattern < pattern - 1 for i in range(n)]
        else:
            k.bad("attention.sliding_window_pattern",
                  f"expected a positive period or per-layer flags, found {short(pattern)}")
    local_base = k.float("rope.freq_base_swa", LOCAL_ROPE_BASE)
    if not local_base > 0:
        k.bad("rope.freq_base_swa", f"expected a positive RoPE base, found {local_base!r}")
    local = RoPE(local_base)
    cap = k.float("final_logit_softcapping", None)
    if cap is not None and not 0 < cap < math.inf:  # NaN, 0 or inf would make every logit NaN or 0
        k.bad("final_logit_softcapping", f"expected a positive number, found {cap!r}")
    if k.get("attn_logit_softcapping") is not None:
        k.bad("attn_logit_softcapping", "attention logit soft-capping is not part of Gemma 3 (Gemma 2's files are "
                                        "general.architecture gemma2)")
    dim = fields["dim"]
    scalar = dim // fields["n_heads"] if n == 62 else fields["head_dim"]  # llama.cpp's rule (62 layers: 27B)
    return {**fields,
            "layer_windows": tuple(window if sw else 0 for sw in sliding),
            "layer_ropes": tuple(local if sw else fields["rope"] for sw in sliding),
            "attn_scale": float(np.float32(scalar ** -0.5)),
            "embed_scale": float(np.float32(dim ** 0.5)),
            "logit_softcap": cap}


def _layer_types(types, window: int, rope: RoPE, local: RoPE) -> dict:
    return {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
            "layer_ropes": tuple(local if t == "sliding_attention" else rope for t in types)}


def _theta_given(c: dict) -> bool:
    """Whether config.json gives the global layers' RoPE base anywhere (else Gemma's 1e6, not 10000)."""
    rs, rp = c.get("rope_scaling"), c.get("rope_parameters")
    full = rp.get("full_attention") if isinstance(rp, dict) else None
    return (c.get("rope_theta") is not None or (isinstance(rs, dict) and rs.get("rope_theta") is not None)
            or (isinstance(full, dict) and full.get("rope_theta") is not None))


def _hf_config(f, fields: dict) -> dict:
    """config.json as transformers' Gemma3TextConfig reads it (module docstring)."""
    c, n = f.c, fields["n_layers"]
    f.tie_default = True  # Gemma3TextConfig's tie_word_embeddings
    act = f.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        f.bad("hidden_activation", f"activation {act!r} is not supported (supported: 'gelu_pytorch_tanh')")
    if c.get("attn_logit_softcapping") is not None:
        f.bad("attn_logit_softcapping", "attention logit soft-capping is not part of Gemma 3 (Gemma 2's "
                                        "config.json is model_type gemma2)")
    if c.get("use_bidirectional_attention"):
        f.bad("use_bidirectional_attention", "bidirectional attention is not supported")
    cap = None
    if c.get("final_logit_softcapping") is not None:
        cap = f.float("final_logit_softcapping")
        if cap <= 0:
            f.bad("final_logit_softcapping", f"expected a positive number or null, found {cap!r}")
    scalar = f.float("query_pre_attn_scalar", 256.0)
    if scalar <= 0:
        f.bad("query_pre_attn_scalar", f"expected a positive number, found {scalar!r}")
    head_dim = fields["head_dim"] if c.get("head_dim") is not None else 256  # Gemma3TextConfig's default

    def pattern_types():  # transformers' rule for configs from before layer_types
        pattern = f.int("sliding_window_pattern", PATTERN)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]

    types = f.layer_types(n, pattern_types)
    window = 0
    if "sliding_attention" in types:
        window = f.int("sliding_window", 4096)  # Gemma3TextConfig's default
        if window > fields["context_length"]:
            f.bad("sliding_window", f"expected a window in 1..max_position_embeddings ({fields['context_length']}), "
                                    f"found {window}")

    rp = c.get("rope_parameters")
    if rp is not None and not per_layer_type(rp):
        f.bad("rope_parameters", "expected an object keyed by layer type ('full_attention', 'sliding_attention'), "
                                 f"as transformers writes Gemma 3's, found {rp!r}")
    rope = fields["rope"] if _theta_given(c) else dataclasses.replace(fields["rope"], base=1_000_000.0)
    local_base = f.float("rope_local_base_freq") if c.get("rope_local_base_freq") is not None else None
    local = RoPE()
    if rp is not None and rp.get("sliding_attention") is not None:
        key = "rope_parameters.sliding_attention"
        local, theta = rope_object(f, key, rp["sliding_attention"], SPEC, None)
        if local.scaling != "none":
            f.bad(key, f"RoPE scaling {local.scaling!r} on the sliding-window layers is not supported "
                       "(Gemma 3 scales the global layers' only)")
        if theta is not None and local_base is not None and theta != local_base:
            f.bad(f"{key}.rope_theta", f"{theta!r} disagrees with rope_local_base_freq {local_base!r}")
        local_base = theta if theta is not None else local_base
    local = dataclasses.replace(local, base=LOCAL_ROPE_BASE if local_base is None else local_base)
    return {**fields, **_layer_types(types, window, rope, local), "rope": rope, "head_dim": head_dim,
            "attn_scale": float(np.float32(scalar ** -0.5)),
            "embed_scale": float(np.float32(fields["dim"] ** 0.5)),
            "logit_softcap": cap}


def query_pre_attn_scalar(cfg) -> int:
    """config.json's query_pre_attn_scalar s for a config's attention scale, float32(s ** -0.5)."""
    scalar = round(cfg.attn_scale ** -2) if cfg.attn_scale is not None else cfg.head_dim
    if float(np.float32(scalar ** -0.5)) != (cfg.attn_scale or float(np.float32(cfg.head_dim ** -0.5))):
        raise TinydetError(f"{cfg.arch}: attention scale {cfg.attn_scale!r} is not float32(s ** -0.5) for an "
                           "integer s")
    return scalar


def _hf_out(cfg) -> dict:
    """config.json's Gemma 3 keys for a config read from a GGUF (convert), in the hub's 4.x form."""
    n = cfg.n_layers
    windows = sorted({cfg.window(i) for i in range(n)} - {0})
    sliding = {cfg.rope_of(i) for i in range(n) if cfg.window(i)}
    full = {cfg.rope_of(i) for i in range(n) if not cfg.window(i)}
    local = next(iter(sliding), RoPE(LOCAL_ROPE_BASE))
    if len(windows) > 1 or len(sliding) > 1 or local.scaling != "none" or full - {cfg.rope}:
        raise TinydetError(f"gemma3: config.json cannot say these layer windows and RoPEs ({cfg.layer_windows}, "
                           f"{cfg.layer_ropes})")
    scalar = query_pre_attn_scalar(cfg)
    types = ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(n)]
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
           "sliding_window": windows[0] if windows else None, "layer_types": types,
           "rope_local_base_freq": local.base,
           "final_logit_softcapping": cfg.logit_softcap, "attn_logit_softcapping": None,
           "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False}
    if types == ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(n)]:
        out["sliding_window_pattern"] = PATTERN  # for transformers versions from before layer_types
    return out


SPEC = ArchSpec(
    name="gemma3",
    gguf_arch="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_type="gemma3_text",
    tensors=TENSORS,
    flags={"qk_norm": True, "post_norms": True, "activation": "gelu_tanh"},
    own_head_dim=True,
    hf_activations=("gelu_pytorch_tanh",),  # config.json's hidden_act (Gemma's own key: hidden_activation)
    rope_scalings=("none", "linear"),
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
