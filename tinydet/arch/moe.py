"""A mixture of experts' settings as each format says them, for the specs that have one (tensors:
`arch.moe_tensors`; the computation: `backends/cpu/moe.py`).

GGUF (llama.cpp's keys): `{arch}.expert_count`, `.expert_used_count`, and the experts' width
`.expert_feed_forward_length` where the architecture's feed_forward_length is a dense width instead
(Qwen3-MoE); the gating and whether the chosen weights are renormalised are fixed per architecture
by llama.cpp, as here, and an `expert_gating_func` that says otherwise is refused. Hugging Face: the
keys of each architecture's transformers config class (the specs name them)."""

from __future__ import annotations

GATING_FUNCS = {"softmax": 1, "softmax_topk": 3}  # llama.cpp's llama_expert_gating_func_type


def gguf_moe(k, fields: dict, norm_topk: bool, gating: str = "softmax", ffn_key: str | None = None,
             required: bool = False) -> dict:
    """`fields` with a GGUF's expert settings; unchanged for a file without experts (expert_count
    absent or 0), which `required` refuses. `ffn_key`: the key of the experts' width, if not
    feed_forward_length."""
    n = k.int("expert_count", 0)
    if n == 0 and required:
        k.bad("expert_count", f"required for {fields['arch']} (a mixture of experts in every layer)")
    if n == 0:
        return fields
    if n < 0:
        k.bad("expert_count", f"expected a positive number of experts, found {n}")
    used = k.int("expert_used_count")
    if not 0 < used <= n:
        k.bad("expert_used_count", f"expected 1..{n} experts per token (expert_count), found {used}")
    func = k.int("expert_gating_func", None)
    if func is not None and func != GATING_FUNCS[gating]:
        k.bad("expert_gating_func", f"expected {GATING_FUNCS[gating]} ({gating}) for this architecture, found {func}")
    ffn = k.int(ffn_key) if ffn_key else fields["ffn_dim"]
    return {**fields, "n_experts": n, "n_experts_used": used, "ffn_dim": ffn, "moe_gating": gating,
            "moe_norm_topk": norm_topk}


def hf_moe(f, fields: dict, experts_key: str, ffn_key: str, norm_topk) -> dict:
    """`fields` with config.json's expert settings: the count under `experts_key`, the experts used
    per token (num_experts_per_tok), their width under `ffn_key`, and `norm_topk` (a bool, or the key
    of one: norm_topk_prob, default false)."""
    n = f.int(experts_key)
    used = f.int("num_experts_per_tok")
    if used > n:
        f.bad("num_experts_per_tok", f"expected 1..{n} experts per token ({experts_key}), found {used}")
    if isinstance(norm_topk, str):
        v = f.c.get(norm_topk, False)
        if not isinstance(v, bool):
            f.bad(norm_topk, f"expected true or false, found {v!r}")
        norm_topk = v
    return {**fields, "n_experts": n, "n_experts_used": used, "ffn_dim": f.int(ffn_key), "moe_gating": "softmax",
            "moe_norm_topk": norm_topk}


def hf_moe_out(cfg, experts_key: str, ffn_key: str, norm_key: str | None) -> dict:
    """config.json's expert keys for a config (convert)."""
    out = {experts_key: cfg.n_experts, "num_experts_per_tok": cfg.n_experts_used, ffn_key: cfg.ffn_dim}
    if norm_key:
        out[norm_key] = cfg.moe_norm_topk
    return out
