"""Model configuration: a frozen dataclass of dimensions and feature flags, built from a file's own
metadata by the format readers (`formats/`) with the flags its architecture sets (`arch/`).

Llama is every flag off. The others, each understood by the kernels:
  head_dim            a head dimension of its own (q_dim = n_heads * head_dim need not equal dim)
  qkv_bias            q, k and v projections add a bias (Qwen2)
  attn_out_bias       the attention's output projection adds a bias (gpt-oss)
  attn_sinks          a learned logit per head joins each softmax's max and denominator, its weight
                      then dropped: the head may attend to nothing (gpt-oss)
  qk_norm             RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
  post_norms          RMSNorm of the attention and of the FFN output before each residual add (Gemma)
  activation          "silu" (SwiGLU), "gelu_tanh" (GeGLU with the tanh approximation) or
                      "swiglu_oai" (gpt-oss's: g = min(gate, 7), u = clamp(up, -7, 7),
                      (u + 1) g sigmoid(1.702 g))
  layer_windows       per layer: 0 for full causal attention, w for only the last w positions (sliding
                      window: a row at position p attends to positions p - w + 1 .. p)
  rope, layer_ropes   the RoPE of every layer, or one per layer (a base and scaling each)
  layer_nope          per layer: True for a layer that rotates nothing (NoPE: q and k used, and k
                      cached, exactly as projected; SmolLM3's every fourth layer); empty: all rotate
  attn_scale          the factor on q.k (default 1 / sqrt(head_dim))
  embed_scale         a factor on the embedded tokens (Gemma: sqrt(dim), as a float32)
  attn_softcap        attention scores (after the scale, before the softmax) become
                      cap * tanh(score / cap) (Gemma 2)
  logit_softcap       final logits become cap * tanh(logits / cap) (Gemma 2/3)
  n_experts           a mixture of experts in every layer's FFN (0: one dense FFN): n_experts FFNs of
                      width ffn_dim, of which each token uses n_experts_used (its top-k by router logit,
                      ties to the lower expert id), their outputs summed in rank order with weights from
  moe_gating          "softmax": the softmax over every expert's logit, taken at the chosen ones (then
                      divided by their sum when moe_norm_topk: Mixtral, Qwen3-MoE); "softmax_topk": the
                      softmax over the chosen logits only (gpt-oss)
  moe_bias            the router and each expert's three products add a bias (gpt-oss)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ModelFormatError

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
MOE_GATINGS = ("softmax", "softmax_topk")
ROPE_SCALINGS = ("none", "linear", "llama3", "factors", "yarn")

# RoPE scalings refused on principle, not for want of code: their frequencies depend on how long the
# sequence is, so a prefix's logits would depend on what follows it, while tinydet's contract is that a
# prefix's logits are the same however it is chunked, cached or continued. Keyed by the names files
# use (config.json's rope_type / type, GGUF's rope.scaling.type).
_CONTRACT = "so a prefix's logits would depend on what follows it, which breaks tinydet's KV-cache and chunking contract"
LENGTH_DEPENDENT_ROPE = {
    "longrope": "LongRoPE switches every position's frequencies from short_factor to long_factor once a sequence "
                f"passes original_max_position_embeddings, {_CONTRACT}",
    "dynamic": "dynamic NTK scaling raises every position's RoPE base once a sequence passes the original "
               f"context, {_CONTRACT}",
}
LENGTH_DEPENDENT_ROPE["su"] = LENGTH_DEPENDENT_ROPE["longrope"]  # LongRoPE's first name (Phi-3 128k)


def rope_refusal(kind) -> str:
    """Why a RoPE scaling is refused, for the end of an error message ("" when it is only unsupported)."""
    reason = LENGTH_DEPENDENT_ROPE.get(str(kind).lower())
    return f": {reason}" if reason else ""


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding: inverse frequencies base**(-2i/head_dim), then scaling:
    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1's) divides the low frequencies by
    `factor`, keeps the high ones and blends in between, over `original_context` positions; "factors"
    divides frequency i by `freq_factors[i]` (a GGUF's `rope_freqs.weight` that no "llama3" setting
    reproduces exactly); "yarn" (YaRN, as transformers' `_compute_yarn_parameters`, static: the same
    for every position and length) blends each frequency between itself and itself / `factor` by a
    ramp over the dimensions whose wavelengths fall between `beta_fast` and `beta_slow` rotations in
    `original_context` positions (`truncate`: the ramp's ends rounded outward to whole dimensions),
    and multiplies cos and sin by `attention_factor`. `rope.inv_freq` computes the frequencies."""

    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    freq_factors: tuple[float, ...] = ()  # scaling "factors" only: one divisor per frequency
    beta_fast: float = 32.0  # "yarn" only (also original_context, factor)
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # on cos and sin ("yarn"; 1.0 otherwise)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope: RoPE = field(default_factory=RoPE)
    # feature flags (module docstring); Llama has all of them off
    qkv_bias: bool = False
    attn_out_bias: bool = False
    attn_sinks: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    layer_windows: tuple[int, ...] = ()  # empty: every layer attends to every earlier position
    layer_ropes: tuple[RoPE, ...] = ()  # empty: every layer uses `rope`
    layer_nope: tuple[bool, ...] = ()  # empty: every layer rotates q and k
    attn_scale: float | None = None
    embed_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    n_experts: int = 0
    n_experts_used: int = 0
    moe_gating: str = "softmax"
    moe_norm_topk: bool = False
    moe_bias: bool = False

    @property
    def dense_ffn(self) -> bool:
        """Whether each layer's FFN is one dense FFN (no experts)."""
        return not self.n_experts

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rope_base(self) -> float:
        return self.rope.base

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends to (0: all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_of(self, layer: int) -> RoPE:
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    def nope(self, layer: int) -> bool:
        """Whether layer `layer` leaves q and k unrotated."""
        return bool(self.layer_nope) and self.layer_nope[layer]

    def validate(self, path, keys: dict[str, str] | None = None) -> "ModelConfig":
        """Check the values make a runnable model; `keys` names each field as the file spells it."""
        def bad(name, msg):
            raise ModelFormatError(path, (keys or {}).get(name, name), msg)

        for name in ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, f"expected a positive integer, found {v!r}")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"{self.n_kv_heads} KV heads do not divide {self.n_heads} query heads")
        if self.head_dim % 2:
            bad("head_dim", f"RoPE needs an even head dimension, found {self.head_dim}")
        if not 0 < self.rms_eps < 1:
            bad("rms_eps", f"expected an RMSNorm epsilon in (0, 1), found {self.rms_eps!r}")
        for i, r in enumerate((self.rope,) + self.layer_ropes):
            name = "rope_base" if i == 0 else f"layer_ropes[{i - 1}]"
            if not (isinstance(r.base, float) and math.isfinite(r.base) and r.base > 0):
                bad(name, f"expected a positive RoPE base, found {r.base!r}")
            if r.scaling not in ROPE_SCALINGS:
                bad(name, f"RoPE scaling {r.scaling!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
            if r.scaling != "none" and not (math.isfinite(r.factor) and r.factor > 0):
                bad(name, f"expected a positive RoPE scaling factor, found {r.factor!r}")
            if r.scaling == "yarn" and not (r.original_context > 0 and r.beta_fast > r.beta_slow > 0
                                            and math.isfinite(r.attention_factor) and r.attention_factor > 0):
                bad(name, "yarn RoPE scaling needs original_context > 0, beta_fast > beta_slow > 0 and a positive "
                          "attention factor")
            if r.scaling == "llama3" and not (r.original_context > 0 and r.high_freq_factor > r.low_freq_factor > 0):
                bad(name, "llama3 RoPE scaling needs original_context > 0 and high_freq_factor > low_freq_factor > 0")
            if (r.scaling == "factors") != bool(r.freq_factors):
                bad(name, "per-frequency RoPE factors go with RoPE scaling 'factors' only")
            if r.freq_factors and (len(r.freq_factors) != self.head_dim // 2 or not all(
                    math.isfinite(x) and x > 0 for x in r.freq_factors)):
                bad(name, f"expected {self.head_dim // 2} positive RoPE frequency factors (head_dim / 2), "
                          f"found {len(r.freq_factors)}")
        if self.activation not in ACTIVATIONS:
            bad("activation", f"expected one of {', '.join(ACTIVATIONS)}, found {self.activation!r}")
        for name, seq in (("layer_windows", self.layer_windows), ("layer_ropes", self.layer_ropes),
                          ("layer_nope", self.layer_nope)):
            if seq and len(seq) != self.n_layers:
                bad(name, f"expected one entry per layer ({self.n_layers}), found {len(seq)}")
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in self.layer_windows):
            bad("layer_windows", f"expected integers >= 0, found {self.layer_windows!r}")
        if any(not isinstance(x, bool) for x in self.layer_nope):
            bad("layer_nope", f"expected true or false per layer, found {self.layer_nope!r}")
        if self.n_experts or self.n_experts_used:
            if not (isinstance(self.n_experts, int) and self.n_experts > 0):
                bad("n_experts", f"expected a positive number of experts, found {self.n_experts!r}")
            if not (isinstance(self.n_experts_used, int) and 0 < self.n_experts_used <= self.n_experts):
                bad("n_experts_used", f"expected 1..{self.n_experts} experts per token (n_experts), "
                                      f"found {self.n_experts_used!r}")
            if self.moe_gating not in MOE_GATINGS:
                bad("moe_gating", f"expected one of {', '.join(MOE_GATINGS)}, found {self.moe_gating!r}")
        for name in ("attn_scale", "embed_scale", "attn_softcap", "logit_softcap"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, float) and math.isfinite(v) and v > 0):
                bad(name, f"expected a positive number or none, found {v!r}")
        return self
