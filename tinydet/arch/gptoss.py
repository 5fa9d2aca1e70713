"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): Llama's layout with biases on q, k, v and
the output projection, a learned sink logit per head in every softmax (`ModelConfig.attn_sinks`),
layers alternating a sliding window (the even ones) with full attention, NEOX RoPE with YaRN, untied
output, and in every layer a mixture of experts: a router with a bias, the softmax over the
num_experts_per_tok best logits only ("softmax_topk"), each expert a clamped SwiGLU
("swiglu_oai": g = min(gate, 7), u = clamp(up, -7, 7), (u + 1) g sigmoid(1.702 g)) whose three
products add biases.

Hugging Face (model_type gpt_oss), as transformers' GptOssConfig reads config.json with its
defaults: num_local_experts, num_experts_per_tok, intermediate_size (the experts' width),
sliding_window (128), layer_types (else the even layers slide), rope_theta 150000 and YaRN (factor
32, original 4096, betas 32 / 1, not truncated) where config.json says no RoPE; swiglu_alpha and
swiglu_limit must be gpt-oss's 1.702 and 7, attention_bias true. The experts are stored per layer,
not per expert: `mlp.experts.gate_up_proj` [experts, dim, 2 ffn] (each expert's [in, out], gate
and up interleaved: columns 0, 2, 4, ... the gate) with `gate_up_proj_bias` [experts, 2 ffn]
interleaved alike, `down_proj` [experts, ffn, dim] with `down_proj_bias` [experts, dim]. The hub's
checkpoints hold gate_up_proj and down_proj as MXFP4 instead (`_blocks`, `_scales`: `hf_mxfp4.py`).

GGUF (llama.cpp's gpt-oss): gpt-oss.expert_count, .expert_used_count, .expert_feed_forward_length,
.attention.sliding_window, rope.scaling.type yarn with .rope.scaling.factor and
.rope.scaling.original_context_length; betas 32 / 1 and the ramp not truncated as config.json says
(llama.cpp rounds the ramp's ends outward; tinydet computes the model's own, so a GGUF and its
Hugging Face source give the same bits); tensors ffn_{gate,up,down}_exps (+ .bias), ffn_gate_inp
(+ .bias), attn_sinks.weight and post_attention_norm (the FFN's norm)."""

from __future__ import annotations

from . import LLAMA_ATTENTION, ArchSpec, TensorSpec, moe_tensors
from .moe import gguf_moe, hf_moe, hf_moe_out
from .qwen2 import _BIASES as QKV_BIASES
from ..config import RoPE
from ..rope import yarn_attention_factor

ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's constants (ops.SWIGLU_OAI computes with these)
WINDOW = 128
THETA = 150000.0
YARN = dict(factor=32.0, original_context=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)

_L = "model.layers.{}."
_X = _L + "mlp.experts."


def _expert_bias(w, gguf, hf, shape, **kw):
    return TensorSpec(f"layers.{{}}.experts.{{}}.{w}", f"blk.{{}}.ffn_{gguf}_exps.bias", _X + hf, shape,
                      flag="moe_bias", experts=True, hf_stacked=True, **kw)


_ATTENTION = tuple(
    # the FFN's norm: GGUF names it post_attention_norm for gpt-oss
    TensorSpec(t.canonical, "blk.{}.post_attention_norm.weight", t.hf, t.shape) if t.canonical == "layers.{}.ffn_norm"
    else t for t in LLAMA_ATTENTION) + QKV_BIASES + (
    TensorSpec("layers.{}.bo", "blk.{}.attn_output.bias", _L + "self_attn.o_proj.bias", ("dim",), flag="attn_out_bias"),
    TensorSpec("layers.{}.sinks", "blk.{}.attn_sinks.weight", _L + "self_attn.sinks", ("n_heads",), flag="attn_sinks"),
)
_router, _w1, _w2, _w3 = moe_tensors("mlp.router", "mlp.experts")
TENSORS = _ATTENTION + (
    _router,
    TensorSpec("layers.{}.router_bias", "blk.{}.ffn_gate_inp.bias", _L + "mlp.router.bias", ("n_experts",),
               flag="moe_bias"),
    TensorSpec(_w1.canonical, _w1.gguf, _X + "gate_up_proj", _w1.shape, flag="n_experts", experts=True,
               hf_stacked=True, hf_transposed=True, hf_interleave=0),
    TensorSpec(_w2.canonical, _w2.gguf, _X + "down_proj", _w2.shape, flag="n_experts", experts=True,
               hf_stacked=True, hf_transposed=True),
    TensorSpec(_w3.canonical, _w3.gguf, _X + "gate_up_proj", _w3.shape, flag="n_experts", experts=True,
               hf_stacked=True, hf_transposed=True, hf_interleave=1),
    _expert_bias("b1", "gate", "gate_up_proj_bias", ("ffn_dim",), hf_interleave=0),
    _expert_bias("b2", "down", "down_proj_bias", ("dim",)),
    _expert_bias("b3", "up", "gate_up_proj_bias", ("ffn_dim",), hf_interleave=1),
)


def _windows(types, window: int):
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _gguf_config(k, fields: dict) -> dict:
    fields = gguf_moe(k, fields, norm_topk=False, gating="softmax_topk", ffn_key="expert_feed_forward_length",
                      required=True)
    window = k.int("attention.sliding_window", WINDOW)
    if window <= 0:
        k.bad("attention.sliding_window", f"expected a positive window, found {window!r}")
    rope = fields["rope"]
    if k.str("rope.scaling.type", "none") == "yarn":
        factor = k.float("rope.scaling.factor", YARN["factor"])
        if not factor > 0:
            k.bad("rope.scaling.factor", f"expected a positive factor, found {factor!r}")
        rope = RoPE(base=rope.base, scaling="yarn", **{**YARN, "factor": factor,
                    "original_context": k.int("rope.scaling.original_context_length", YARN["original_context"])},
                    attention_factor=yarn_attention_factor(factor))
    n = fields["n_layers"]
    return {**fields, "rope": rope, "layer_windows": _windows(_default_types(n), window)}


def _default_types(n: int) -> list[str]:
    """The even layers slide (GptOssConfig's rule, llama.cpp's swa pattern of 2)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _hf_config(f, fields: dict) -> dict:
    c, n = f.c, fields["n_layers"]
    for key, want in (("swiglu_alpha", ALPHA), ("swiglu_limit", LIMIT)):
        if f.float(key, want) != want:
            f.bad(key, f"only gpt-oss's {want} is supported, found {c[key]!r}")
    if c.get("attention_bias") is False:
        f.bad("attention_bias", "gpt-oss without attention biases is not supported")
    types = f.layer_types(n, lambda: _default_types(n))
    window = f.int("sliding_window", WINDOW) if "sliding_attention" in types else 0
    rope = fields["rope"]
    if c.get("rope_scaling") is None and c.get("rope_parameters") is None:  # GptOssConfig's default
        rope = RoPE(base=rope.base, scaling="yarn", **YARN, attention_factor=yarn_attention_factor(YARN["factor"]))
    if c.get("rope_theta") is None and not (c.get("rope_parameters") or {}).get("rope_theta"):
        rope = RoPE(**{**rope.__dict__, "base": THETA})
    fields = {**fields, "rope": rope, "layer_windows": _windows(types, window)}
    return {**hf_moe(f, fields, "num_local_experts", "intermediate_size", None), "moe_gating": "softmax_topk",
            "moe_norm_topk": False}


def _hf_out(cfg) -> dict:
    windows = sorted({cfg.window(i) for i in range(cfg.n_layers)} - {0})
    return {**hf_moe_out(cfg, "num_local_experts", "intermediate_size", None), "hidden_act": "silu",
            "swiglu_alpha": ALPHA, "swiglu_limit": LIMIT, "attention_bias": True, "attention_dropout": 0.0,
            "sliding_window": windows[0] if windows else WINDOW,
            "layer_types": ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)]}


SPEC = ArchSpec(
    name="gptoss",
    gguf_arch="gpt-oss",
    hf_architectures=("GptOssForCausalLM",),
    hf_model_type="gpt_oss",
    tensors=TENSORS,
    flags={"qkv_bias": True, "attn_out_bias": True, "attn_sinks": True, "moe_bias": True,
           "activation": "swiglu_oai"},
    own_head_dim=True,
    rope_scalings=("none", "yarn"),
    gguf_yarn=True,
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
