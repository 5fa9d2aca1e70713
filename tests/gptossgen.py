"""A tiny gpt-oss made here, deterministically, for tests: the same random weights written as

* a Hugging Face directory (`write_hf_dir`) in transformers' own layout (GptOssExperts): per layer,
  every expert's matrices in one tensor, each expert's [in, out] (`mlp.experts.gate_up_proj` [experts,
  dim, 2 ffn], gate and up interleaved in its columns; `down_proj` [experts, ffn, dim]) with biases
  `gate_up_proj_bias` (interleaved alike) and `down_proj_bias`; the router `mlp.router` with a bias,
  attention biases, `self_attn.sinks`; config.json in the hub's form (rope_scaling YaRN, factor 32,
  not truncated; layer_types alternating); the tokenizer files of `qwen2gen`;
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

import qwen2gen as Q
from tinygen import QUANTS, add_tensor, write_json

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
    tj = Q.tokenizer_json(TOK)
    return 1 + max(list(tj["model"]["vocab"].values()) + [t["id"] for t in tj["added_tokens"]])


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
         "bos_token_id": Q.token_id("<|endoftext|>"), "eos_token_id": Q.token_id("<|im_end|>"),
         "pad_token_id": Q.token_id("<|endoftext|>")}
    if mxfp4:
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return dict(sorted(c.items()))


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights under transformers' names and layout, float32, drawn in a fixed order."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    def norm(n=HIDDEN):
        return (1.0 + rs.standard_normal(n) * 0.1).astype(np.float32)

    q, kv, V = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, vocab_size()
    sd = {"model.embed_tokens.weight": normal((V, HIDDEN), 0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.weight"] = normal((rows, HIDDEN), 0.08)
            sd[p + f"self_attn.{x}_proj.bias"] = normal(rows, 0.1)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), 0.08)
        sd[p + "self_attn.o_proj.bias"] = normal(HIDDEN, 0.1)
        sd[p + "self_attn.sinks"] = normal(HEADS, 1.0)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.router.weight"] = normal((EXPERTS, HIDDEN), ROUTER_STD)
        sd[p + "mlp.router.bias"] = normal(EXPERTS, 0.3)
        sd[p + "mlp.experts.gate_up_proj"] = normal((EXPERTS, HIDDEN, 2 * FFN), EXPERT_STD)
        sd[p + "mlp.experts.gate_up_proj_bias"] = normal((EXPERTS, 2 * FFN), 3.0)
        sd[p + "mlp.experts.down_proj"] = normal((EXPERTS, FFN, HIDDEN), 0.02)
        sd[p + "mlp.experts.down_proj_bias"] = normal((EXPERTS, HIDDEN), 0.1)
    sd["model.norm.weight"] = norm()
    sd["lm_head.weight"] = normal((V, HIDDEN), 0.2)
    return sd


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
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if sd is None:
        sd = mxfp4_state_dict(seed) if mxfp4 else state_dict(seed)
    save_file({k: sd[k] for k in sorted(sd)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = config_json(mxfp4)
    write_json(out / "config.json", c)
    write_json(out / "generation_config.json", {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]})
    Q.write_tokenizer_files(out, TOK)
    return out


def hf_model(hf_dir: Path):
    """transformers' model of the directory, float32, eager attention, eval mode."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()


def write_gguf(path: Path, quant: str | None = None, seed: int = 0, expert_quant: str | None = None,
               sd: dict | None = None) -> Path:
    """The GGUF; matrices in `quant` but the experts' in `expert_quant` (the hub's files: MXFP4), the
    router and every vector F32."""
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    path = Path(path)
    sd = state_dict(seed) if sd is None else sd
    w = GGUFWriter(path, "gpt-oss")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("Tiny gpt-oss")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_sliding_window(WINDOW)
    w.add_expert_feed_forward_length(FFN)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN["factor"])
    w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    w.add_file_type(LlamaFileType[QUANTS[expert_quant or quant][1]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, toktypes, merges = Q.gguf_vocab(TOK)
    tokens, toktypes = tokens[:vocab_size()], toktypes[:vocab_size()]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    c = config_json()
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_chat_template(Q.CHAT_TEMPLATE)

    add_tensor(w, "token_embd.weight", sd["model.embed_tokens.weight"], quant)
    add_tensor(w, "output_norm.weight", sd["model.norm.weight"], None)
    add_tensor(w, "output.weight", sd["lm_head.weight"], quant)
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                       ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                       ("post_attention_layernorm", "post_attention_norm"), ("mlp.router", "ffn_gate_inp")):
            add_tensor(w, b + gg + ".weight", sd[p + hf + ".weight"], None if gg == "ffn_gate_inp" else quant)
            if p + hf + ".bias" in sd:
                add_tensor(w, b + gg + ".bias", sd[p + hf + ".bias"], None)
        add_tensor(w, b + "attn_sinks.weight", sd[p + "self_attn.sinks"], None)
        gu = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [experts, 2 ffn, dim]
        gub = sd[p + "mlp.experts.gate_up_proj_bias"]
        eq = expert_quant or quant
        add_tensor(w, b + "ffn_gate_exps.weight", np.ascontiguousarray(gu[:, 0::2]), eq)
        add_tensor(w, b + "ffn_up_exps.weight", np.ascontiguousarray(gu[:, 1::2]), eq)
        add_tensor(w, b + "ffn_down_exps.weight", np.ascontiguousarray(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)),
                   eq)
        add_tensor(w, b + "ffn_gate_exps.bias", np.ascontiguousarray(gub[:, 0::2]), None)
        add_tensor(w, b + "ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]), None)
        add_tensor(w, b + "ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"], None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
