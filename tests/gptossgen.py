"""A tiny gpt-oss made here, deterministically, for tests: the same random weights written as

* a Hugging Face directory (`write_hf_dir`) in transformers' own layout (GptOssExperts): per layer,
  every expert's matrices in one tensor, each expert's [in, out] (`mlp.experts.gate_up_proj` [experts,
  dim, 2 ffn], gate and up interleaved in its columns; `down_proj` [experts, ffn, dim]) with biases
  `gate_up_proj_bias` (interleaved alike) and `down_proj_bias`; the router `mlp.router` with a bias,
  attention biases, `self_attn.sinks`; config.json in the hub's form (rope_scaling YaRN, factor 32,
  not truncated; layer_types alternating); the tokenizer files of `bpetok`;
* with `mxfp4=True`, that directory as the hub's checkpoints store it: gate_up_proj and down_proj as
  MXFP4 `_blocks` [experts, out, in / 32, 16] and `_scales` [experts, out, in / 32] (two FP4 codes a
  byte, the lower nibble first; an exponent byte with bias 127), quantization_config mxfp4;
* a GGUF file (`write_gguf`) as llama.cpp's converter writes it: ffn_{gate,up,down}_exps split and
  transposed back to [experts, out, in], their biases, ffn_gate_inp (+ bias), attn_sinks.weight,
  post_attention_norm, the gpt-oss.* keys with YaRN.

Model: 4 layers (the even ones slide, over 8 positions), hidden 64, 4 heads of 32 over 2 KV heads,
8 experts of width 64 of which each token takes 2. Expert weights are large (EXPERT_STD) so that the
activation's clamp at 7 binds on many elements.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import bpetok
from tinygen import Body, Tiny, draw_weights, file_type, load_hf_dir

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 4, 2, 32
EXPERTS, USED, FFN = 8, 2, 64
WINDOW = 8
CONTEXT = 512
RMS_EPS = 1e-5
THETA = 150000.0
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
ROUTER_STD, EXPERT_STD = 0.6, 0.25
TOK = "qwen2"


def vocab_size() -> int:
    return bpetok.vocab_size(TOK)


def config_json(mxfp4: bool = False) -> dict:
    c = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
         "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": HIDDEN, "head_dim": HEAD_DIM,
         "initializer_range": 0.02, "intermediate_size": FFN, "max_position_embeddings": CONTEXT,
         "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
         "num_local_experts": EXPERTS, "num_experts_per_tok": USED, "experts_per_token": USED,
         "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)],
         "sliding_window": WINDOW, "rms_norm_eps": RMS_EPS, "rope_theta": THETA, "rope_scaling": dict(YARN),
         "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
         "vocab_size": vocab_size(), "output_router_logits": False, "router_aux_loss_coef": 0.9,
         "bos_token_id": bpetok.token_id("<|endoftext|>"), "eos_token_id": bpetok.token_id("<|im_end|>"),
         "pad_token_id": bpetok.token_id("<|endoftext|>")}
    if mxfp4:
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return dict(sorted(c.items()))


def _attn_out(p, normal):  # tinygen.draw_weights' extras after o_proj
    return {p + "self_attn.o_proj.bias": normal(HIDDEN, 0.1), p + "self_attn.sinks": normal(HEADS, 1.0)}


def _mlp(p, i, normal):  # the router and every expert's matrices in one tensor (transformers' layout)
    return {p + "mlp.router.weight": normal((EXPERTS, HIDDEN), ROUTER_STD),
            p + "mlp.router.bias": normal(EXPERTS, 0.3),
            p + "mlp.experts.gate_up_proj": normal((EXPERTS, HIDDEN, 2 * FFN), EXPERT_STD),
            p + "mlp.experts.gate_up_proj_bias": normal((EXPERTS, 2 * FFN), 3.0),
            p + "mlp.experts.down_proj": normal((EXPERTS, FFN, HIDDEN), 0.02),
            p + "mlp.experts.down_proj_bias": normal((EXPERTS, HIDDEN), 0.1)}


def _layout(expert_quant: str | None):
    """Tiny.layout: the tensors as llama.cpp's converter writes them (module docstring)."""

    def layout(sd, quant):
        eq = expert_quant or quant
        out = [("token_embd.weight", sd["model.embed_tokens.weight"], quant),
               ("output_norm.weight", sd["model.norm.weight"], None), ("output.weight", sd["lm_head.weight"], quant)]
        for i in range(LAYERS):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            for hf, gg in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                           ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                           ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "post_attention_norm"),
                           ("mlp.router", "ffn_gate_inp")):
                out.append((b + gg + ".weight", sd[p + hf + ".weight"], None if gg == "ffn_gate_inp" else quant))
                if p + hf + ".bias" in sd:
                    out.append((b + gg + ".bias", sd[p + hf + ".bias"], None))
            out.append((b + "attn_sinks.weight", sd[p + "self_attn.sinks"], None))
            gu = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [experts, 2 ffn, dim]
            gub = sd[p + "mlp.experts.gate_up_proj_bias"]
            down = np.ascontiguousarray(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1))
            out += [(b + "ffn_gate_exps.weight", np.ascontiguousarray(gu[:, 0::2]), eq),
                    (b + "ffn_up_exps.weight", np.ascontiguousarray(gu[:, 1::2]), eq),
                    (b + "ffn_down_exps.weight", down, eq),
                    (b + "ffn_gate_exps.bias", np.ascontiguousarray(gub[:, 0::2]), None),
                    (b + "ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]), None),
                    (b + "ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"], None)]
        return out
    return layout


def spec(mxfp4: bool = False, expert_quant: str | None = None) -> Tiny:
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, vocab_size(), bias_std=0.1)
    a = "gpt-oss"
    hparams = {f"{a}.block_count": LAYERS, f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN,
               f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.key_length": HEAD_DIM,
               f"{a}.attention.value_length": HEAD_DIM, f"{a}.rope.freq_base": THETA,
               f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS, f"{a}.expert_count": EXPERTS,
               f"{a}.expert_used_count": USED, f"{a}.attention.sliding_window": WINDOW,
               f"{a}.expert_feed_forward_length": FFN, f"{a}.rope.scaling.type": "yarn",
               f"{a}.rope.scaling.factor": YARN["factor"],
               f"{a}.rope.scaling.original_context_length": YARN["original_max_position_embeddings"],
               "general.file_type": file_type(expert_quant) if expert_quant else None}
    c = config_json(mxfp4)
    specials = [("add_bos_token_id", c["bos_token_id"]), ("add_eos_token_id", c["eos_token_id"]),
                ("add_chat_template", bpetok.CHAT_TEMPLATE)]
    return Tiny("gptoss", "gpt-oss", body, c, {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]},
                lambda d: bpetok.write_tokenizer_files(d, TOK), a, hparams,
                lambda w: bpetok.add_vocab(w, TOK, vocab_size(), specials), size_label=False,
                draw=lambda seed: draw_weights(body, seed, _attn_out, _mlp), layout=_layout(expert_quant),
                save_pretrained=False)


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under transformers' names and layout, float32, drawn in a fixed order."""
    return spec().state_dict(seed)


# FP4 (E2M1) codes' values, as the OCP MX spec and transformers' mxfp4 integration list them.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def mxfp4_encode(w: np.ndarray, rs: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] float32 -> the hub's (blocks [..., out, in / 32, 16] uint8, scales [..., out,
    in / 32] uint8): per 32 inputs an exponent near the block's largest magnitude, each value the
    nearest FP4 code (its exact value is what the checkpoint then holds)."""
    *lead, n, k = w.shape
    b = w.reshape(*lead, n, k // 32, 32)
    amax = np.abs(b).max(-1)
    e = np.floor(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64) + 1 + rs.randint(-1, 1, amax.shape)
    e = np.clip(e, -20, 20)
    scaled = b / np.exp2(e)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


def mxfp4_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The hub's MXFP4 checkpoint: state_dict() with every expert matrix encoded as MXFP4 ([experts,
    out, in], as the hub stores blocks). Its values are transformers' to say (`hf_values`)."""
    rs = np.random.RandomState(seed + 1)
    hub = {}
    for k, v in state_dict(seed).items():
        if k.endswith(("gate_up_proj", "down_proj")):
            hub[k + "_blocks"], hub[k + "_scales"] = mxfp4_encode(np.ascontiguousarray(v.transpose(0, 2, 1)), rs)
        else:
            hub[k] = v
    return hub


def hf_values(hub: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An MXFP4 checkpoint's float32 values in transformers' layout, decoded by transformers' own
    `convert_moe_packed_tensors` (what it runs to load the hub's checkpoints without MXFP4 kernels)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = {}
    for k, v in hub.items():
        if k.endswith("_blocks"):
            name = k.removesuffix("_blocks")
            out[name] = convert_moe_packed_tensors(torch.from_numpy(v), torch.from_numpy(hub[name + "_scales"]),
                                                   dtype=torch.float32).numpy()
        elif not k.endswith("_scales"):
            out[k] = v
    return out


def write_hf_dir(out: Path, seed: int = 0, mxfp4: bool = False, sd: dict | None = None) -> Path:
    if sd is None:
        sd = mxfp4_state_dict(seed) if mxfp4 else state_dict(seed)
    return spec(mxfp4).write_hf_dir(out, seed, weights=sd)


hf_model = load_hf_dir  # transformers' model of the directory, float32, eager attention, eval mode


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, expert_quant: str | None = None,
               sd: dict | None = None) -> Path:
    """The GGUF; matrices in `quant` but the experts' in `expert_quant` (the hub's files: MXFP4), the
    router and every vector F32."""
    return spec(expert_quant=expert_quant).write_gguf(path, quant, seed, weights=sd)
