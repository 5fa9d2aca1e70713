"""RoPE parameters as config.json says them, read for any spec: transformers 4.x's rope_scaling,
5.x's rope_parameters, and 5.x's rope_parameters keyed by layer type (Gemma 3). The Hugging Face
reader (`formats/hf_dir.py`) reads the global RoPE through `rope_object`; a spec's `hf_config` hook
reads its other layer types' (`gemma3.py`)."""

from __future__ import annotations

from . import ArchSpec
from ..config import RoPE, rope_refusal
from ..rope import yarn_attention_factor

# RoPE parameters each scaling type reads from rope_scaling / rope_parameters.
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                       "attention_factor")}
_ROPE_NAMES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# transformers 5 keys rope_parameters by layer type for models whose layers differ (Gemma 3).
LAYER_TYPES = ("full_attention", "sliding_attention")


def per_layer_type(rp) -> bool:
    """Whether a rope_parameters value is keyed by layer type ({"full_attention": {...}, ...})."""
    return isinstance(rp, dict) and bool(rp) and set(rp) <= set(LAYER_TYPES) and all(
        v is None or isinstance(v, dict) for v in rp.values())


def rope_object(f, key: str, rp, spec: ArchSpec, theta: float | None) -> tuple[RoPE, float | None]:
    """One RoPE parameter object (config.json's `key`: rope_scaling, rope_parameters or one of its
    per-layer-type entries) -> (its RoPE, with base 10000 for now; the base: its rope_theta, else
    `theta`). A rope_theta that disagrees with `theta` is refused. `f` is config.json's reader, as the
    specs' `hf_config` hooks get it."""
    if not isinstance(rp, dict):
        f.bad(key, f"expected an object or null, found {rp!r}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if not isinstance(kind, str):  # a list or an object would be unhashable in the lookup below
        f.bad(f"{key}.{'rope_type' if 'rope_type' in rp else 'type'}", f"expected a string, found {kind!r}")
    if _ROPE_NAMES.get(kind) not in spec.rope_scalings:
        supported = ", ".join(repr(k) for k, v in _ROPE_NAMES.items() if v in spec.rope_scalings)
        f.bad(key, f"RoPE scaling {kind!r} is not supported (supported: {supported}){rope_refusal(kind)}")
    # transformers 5 writes partial_rotary_factor into rope_parameters (Phi-3's 1.0, Phi-4-mini's 0.75)
    prf = rp.get("partial_rotary_factor", 1.0)
    if isinstance(prf, bool) or prf not in (1, 1.0, None):
        f.bad(f"{key}.partial_rotary_factor", f"partial RoPE is not supported, found {prf!r}")
    extra = set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"} - set(_ROPE_KEYS[kind])
    if extra:
        f.bad(key, f"RoPE parameters {sorted(extra)} are not supported")
    if rp.get("rope_theta") is not None:
        t = rp["rope_theta"]
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            f.bad(f"{key}.rope_theta", f"expected a number, found {t!r}")
        if theta is not None and float(t) != theta:
            f.bad(f"{key}.rope_theta", f"{t!r} disagrees with rope_theta {theta!r}")
        theta = float(t)
    sub = f.nested(key, rp)
    rope = RoPE()
    if kind == "linear":
        rope = RoPE(scaling="linear", factor=sub.float("factor"))
    elif kind == "llama3":
        rope = RoPE(scaling="llama3", factor=sub.float("factor"), low_freq_factor=sub.float("low_freq_factor"),
                    high_freq_factor=sub.float("high_freq_factor"),
                    original_context=sub.int("original_max_position_embeddings"))
    elif kind == "yarn":  # transformers' _compute_yarn_parameters, its defaults where a key is absent
        factor = sub.float("factor")
        truncate = rp.get("truncate", True)
        if not isinstance(truncate, bool):
            sub.bad("truncate", f"expected true or false, found {truncate!r}")
        rope = RoPE(scaling="yarn", factor=factor, original_context=sub.int("original_max_position_embeddings"),
                    beta_fast=sub.float("beta_fast", 32.0), beta_slow=sub.float("beta_slow", 1.0), truncate=truncate,
                    attention_factor=sub.float("attention_factor", yarn_attention_factor(factor)))
    return rope, theta
