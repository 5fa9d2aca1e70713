"""SmolLM3 (SmolLM3ForCausalLM, config.json model_type "smollm3", GGUF `smollm3`): Llama's tensors, GQA,
an output tied to the embedding by default, and NoPE layers: every layer but some rotates q and k
with RoPE; a NoPE layer (ModelConfig.layer_nope) uses q and k exactly as projected, and caches k so.

GGUF (llama.cpp's smollm3): its converter is LlamaModel's, so Q/K rows are permuted for llama.cpp's
interleaved RoPE (moved back at load, as for Llama) and the RoPE scaling is Llama's keys or
rope_freqs.weight. The file says nothing of NoPE: llama.cpp fixes the layer step at 4 (layers 3, 7,
11, ... rotate nothing; `n_no_rope_layer_step`), and so does this spec. llama.cpp's smollm3 has no
sliding-window layers: a file with a non-zero `smollm3.attention.sliding_window` is refused.

Hugging Face, read as transformers' SmolLM3Config reads config.json, with its defaults where a key is
absent:
  no_rope_layers          one 0/1 per layer (at least num_hidden_layers entries; 1 = RoPE), else
  no_rope_layer_interval  (default 4): layer i has no RoPE where (i + 1) % interval == 0
  rope_theta              2e6 when config.json gives no base anywhere (SmolLM3Config.default_theta)
  layer_types             else "sliding_attention" for the NoPE layers where use_sliding_window and
                          sliding_window are set (SmolLM3Config's rule), "full_attention" elsewhere;
                          a sliding layer attends to the last sliding_window positions (eager
                          attention's mask). Sliding layers with use_sliding_window false are refused
                          (transformers' flash attention would not slide them, its mask would), and so
                          are sliding layers without a sliding_window.
  tie_word_embeddings     default true.
"""

from __future__ import annotations

import dataclasses

from . import LLAMA_TENSORS, ArchSpec
from ..errors import TinydetError

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3, SmolLM3Config's no_rope_layer_interval
DEFAULT_THETA = 2_000_000.0  # SmolLM3Config.default_theta


def _every(step: int, n: int) -> tuple[bool, ...]:
    return tuple((i + 1) % step == 0 for i in range(n))


def _gguf_config(k, fields: dict) -> dict:
    if k.int("attention.sliding_window", 0):
        k.bad("attention.sliding_window", "llama.cpp's smollm3 has no sliding-window layers")
    return {**fields, "layer_nope": _every(NO_ROPE_STEP, fields["n_layers"])}


def _theta_given(c: dict) -> bool:
    rs, rp = c.get("rope_scaling"), c.get("rope_parameters")
    return (c.get("rope_theta") is not None or any(isinstance(x, dict) and x.get("rope_theta") is not None
                                                   for x in (rs, rp)))


def _hf_config(f, fields: dict) -> dict:
    """config.json as SmolLM3Config reads it (module docstring)."""
    c, n = f.c, fields["n_layers"]
    f.tie_default = True
    flags = c.get("no_rope_layers")
    if flags is None:
        nope = _every(f.int("no_rope_layer_interval", NO_ROPE_STEP), n)
    elif (not isinstance(flags, list) or len(flags) < n
          or not all(x in (0, 1) and type(x) in (int, bool) for x in flags)):
        f.bad("no_rope_layers", f"expected at least {n} entries of 0 (no RoPE) or 1 (RoPE), found {flags!r}")
    else:
        nope = tuple(not x for x in flags[:n])

    use = c.get("use_sliding_window", False)
    if not isinstance(use, bool):
        f.bad("use_sliding_window", f"expected true or false, found {use!r}")
    slide = use and c.get("sliding_window") is not None
    types = f.layer_types(n, lambda: ["sliding_attention" if slide and nope[i] else "full_attention" for i in range(n)])
    window = 0
    if "sliding_attention" in types:
        if not use:
            f.bad("use_sliding_window", "false, but layer_types has sliding layers (transformers' attention "
                                        "implementations disagree on such a model)")
        window = f.int("sliding_window")
    rope = fields["rope"] if _theta_given(c) else dataclasses.replace(fields["rope"], base=DEFAULT_THETA)
    return {**fields, "rope": rope, "layer_nope": nope,
            "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types) if window else ()}


def _hf_out(cfg) -> dict:
    """config.json's SmolLM3 keys (convert): the NoPE layers as no_rope_layers, whatever their pattern."""
    n = cfg.n_layers
    nope = tuple(cfg.nope(i) for i in range(n))
    windows = sorted({cfg.window(i) for i in range(n)} - {0})
    if len(windows) > 1:
        raise TinydetError(f"smollm3: config.json cannot say these layer windows ({cfg.layer_windows})")
    out = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
           "no_rope_layers": [int(not x) for x in nope], "use_sliding_window": bool(windows),
           "sliding_window": windows[0] if windows else None,
           "layer_types": ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(n)]}
    if nope == _every(NO_ROPE_STEP, n):
        out["no_rope_layer_interval"] = NO_ROPE_STEP
    return out


SPEC = ArchSpec(
    name="smollm3",
    gguf_arch="smollm3",
    hf_architectures=("SmolLM3ForCausalLM",),
    hf_model_type="smollm3",
    tensors=LLAMA_TENSORS,
    gguf_rope_permuted=True,
    own_head_dim=True,  # config.json head_dim (SmolLM3Attention reads it where given) / GGUF key_length
    rope_scalings=("none", "linear", "llama3", "factors", "yarn"),  # yarn: config.json's (the 128k setting)
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    hf_config_out=_hf_out,
)
