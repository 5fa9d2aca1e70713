"""Tiny mixture-of-experts checkpoints made here, deterministically, for tests: Qwen3-MoE ("qwen3moe"),
Mixtral ("mixtral") and OLMoE ("olmoe"), the same random weights written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors with the hub's names, one tensor per
  expert matrix (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`, as the
  published Qwen3-30B-A3B and Mixtral-8x7B repos store them; transformers 5 merges them at load),
  config.json in the hub's form, and the tokenizer files of `bpetok` (Qwen2's BPE for Qwen3-MoE,
  the Llama 3 one for Mixtral);
* a GGUF file (`write_gguf`) as llama.cpp's converter writes it: every expert of a layer in one 3-D
  tensor (`ffn_gate_exps` [experts, ffn, dim], ...), the router `ffn_gate_inp` kept F32 whatever the
  output type (the converter's rule for FFN_GATE_INP), `{arch}.expert_count` / `expert_used_count`
  (and Qwen3-MoE's `expert_feed_forward_length`); Mixtral as a `llama` file, Q/K rows permuted.

Models: 2 layers, hidden 64, 4 heads over 2 KV heads, 8 experts of which each token takes 2. Qwen3-MoE:
head_dim 32 (q_dim 128), QK-norm, expert width 64 (the fused gate/up product's path), norm_topk_prob
true. Mixtral: expert width 96 (not a multiple of 64: the unfused path). OLMoE: q/k norms over all of
q (64) and of k (32), norm_topk_prob false, a `olmoe` GGUF (nothing permuted). Router weights are large
(ROUTER_STD) so that tokens spread over the experts. `state_dict(..., tie=(3, 5))` gives experts 3 and 5
of layer 0 the same router row: equal logits on every token, a tie the lower id must win.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import bpetok
from tinygen import Body, Tiny, draw_weights, llama_permute, load_hf_dir

HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2
EXPERTS, USED = 8, 2
CONTEXT = 512
RMS_EPS = 1e-6
ROUTER_STD = 0.6
ARCHS = {
    # arch: (head_dim, expert width, rope theta, bpetok's tokenizer)
    "qwen3moe": (32, 64, 1_000_000.0, "qwen2"),
    "mixtral": (HIDDEN // HEADS, 96, 1_000_000.0, "llama3"),
    "olmoe": (HIDDEN // HEADS, 64, 10_000.0, "llama3"),
}
GGUF_ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}


def vocab_size(arch: str) -> int:
    """The tokenizer's size: the embedding is not padded past it (a padded row's token could be sampled,
    and a tokenizer cannot decode it)."""
    return bpetok.vocab_size(ARCHS[arch][3])


def _names(arch: str) -> tuple[str, str, tuple[str, str, str]]:
    """(router, experts prefix, expert matrix names gate/down/up) under model.layers.{i}."""
    if arch == "mixtral":
        return "block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w2", "w3")
    return "mlp.gate", "mlp.experts", ("gate_proj", "down_proj", "up_proj")


def config_json(arch: str) -> dict:
    hd, ffn, theta, tok = ARCHS[arch]
    c = {"attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
         "max_position_embeddings": CONTEXT, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
         "num_key_value_heads": KV_HEADS, "num_experts_per_tok": USED, "rms_norm_eps": RMS_EPS,
         "rope_theta": theta, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
         "vocab_size": vocab_size(arch), "output_router_logits": False, "router_aux_loss_coef": 0.001}
    if arch == "olmoe":
        c.update(architectures=["OlmoeForCausalLM"], model_type="olmoe", intermediate_size=ffn, num_experts=EXPERTS,
                 norm_topk_prob=False, clip_qkv=None, attention_bias=False,
                 bos_token_id=bpetok.token_id("<|begin_of_text|>", tok),
                 eos_token_id=bpetok.token_id("<|eot_id|>", tok))
    elif arch == "mixtral":
        c.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=ffn,
                 num_local_experts=EXPERTS, sliding_window=None, router_jitter_noise=0.0,
                 bos_token_id=bpetok.token_id("<|begin_of_text|>", tok),
                 eos_token_id=bpetok.token_id("<|eot_id|>", tok))
    else:
        c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=4 * ffn,
                 moe_intermediate_size=ffn, num_experts=EXPERTS, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], head_dim=hd, attention_bias=False, use_sliding_window=False,
                 sliding_window=None, max_window_layers=LAYERS, bos_token_id=bpetok.token_id("<|endoftext|>"),
                 eos_token_id=bpetok.token_id("<|im_end|>"))
    return dict(sorted(c.items()))


def _experts(arch: str, tie) -> callable:
    """tinygen.draw_weights' mlp: the router (experts tie[0] and tie[1] of layer 0 with one row), then
    each expert's gate, up and down."""
    ffn = ARCHS[arch][1]
    router, experts, (g, d, u) = _names(arch)

    def mlp(p, i, normal):
        sd = {}
        r = normal((EXPERTS, HIDDEN), ROUTER_STD)
        if tie is not None and i == 0:
            r[tie[1]] = r[tie[0]]
        sd[p + router + ".weight"] = r
        for e in range(EXPERTS):
            sd[p + f"{experts}.{e}.{g}.weight"] = normal((ffn, HIDDEN), 0.1)
            sd[p + f"{experts}.{e}.{u}.weight"] = normal((ffn, HIDDEN), 0.1)
            sd[p + f"{experts}.{e}.{d}.weight"] = normal((HIDDEN, ffn), 0.1)
        return sd
    return mlp


def _layout(arch: str) -> callable:
    """Tiny.layout: the converter's tensors, every expert of a layer in one 3-D tensor, the router F32."""
    router, experts, (g, d, u) = _names(arch)

    def layout(sd, quant):
        out = [("token_embd.weight", sd["model.embed_tokens.weight"], quant),
               ("output_norm.weight", sd["model.norm.weight"], quant), ("output.weight", sd["lm_head.weight"], quant)]
        for i in range(LAYERS):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            for hf, gg in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                           ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                           ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
                           ("self_attn.k_norm", "attn_k_norm"), ("post_attention_layernorm", "ffn_norm")):
                if p + hf + ".weight" in sd:
                    a = sd[p + hf + ".weight"]
                    if arch == "mixtral" and gg in ("attn_q", "attn_k"):
                        a = llama_permute(a, HEADS if gg == "attn_q" else KV_HEADS)
                    out.append((b + gg + ".weight", a, quant))
            out.append((b + "ffn_gate_inp.weight", sd[p + router + ".weight"], None))  # kept F32
            for name, gg in ((g, "ffn_gate_exps"), (d, "ffn_down_exps"), (u, "ffn_up_exps")):
                stack = np.stack([sd[p + f"{experts}.{e}.{name}.weight"] for e in range(EXPERTS)])
                out.append((b + gg + ".weight", stack, quant))
        return out
    return layout


def spec(arch: str, tie: tuple[int, int] | None = None) -> Tiny:
    hd, ffn, theta, tok = ARCHS[arch]
    qk_norm = {"qwen3moe": "head", "olmoe": "all"}.get(arch)  # OLMoE's over the whole of q and of k
    body = Body(HIDDEN, LAYERS, HEADS, KV_HEADS, hd, ffn, vocab_size(arch), qk_norm=qk_norm)
    a = GGUF_ARCH[arch]
    hparams = {f"{a}.block_count": LAYERS, f"{a}.context_length": CONTEXT, f"{a}.embedding_length": HIDDEN,
               f"{a}.feed_forward_length": 4 * ffn if arch == "qwen3moe" else ffn, f"{a}.attention.head_count": HEADS,
               f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.rope.freq_base": theta,
               f"{a}.attention.layer_norm_rms_epsilon": RMS_EPS, f"{a}.expert_count": EXPERTS,
               f"{a}.expert_used_count": USED}
    if arch == "qwen3moe":
        hparams |= {f"{a}.attention.key_length": hd, f"{a}.attention.value_length": hd,
                    f"{a}.expert_feed_forward_length": ffn}
    hparams["general.file_type"] = None
    if arch == "mixtral":
        hparams |= {f"{a}.vocab_size": vocab_size(arch), f"{a}.rope.dimension_count": hd}
    c = config_json(arch)
    specials = [("add_bos_token_id", c["bos_token_id"]), ("add_eos_token_id", c["eos_token_id"]),
                ("add_add_bos_token", tok == "llama3"),
                ("add_chat_template", bpetok.LLAMA3_CHAT_TEMPLATE if tok == "llama3" else bpetok.CHAT_TEMPLATE)]
    return Tiny(arch + ("-tie" if tie else ""), arch, body, c,
                {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]},
                lambda d: bpetok.write_tokenizer_files(d, tok), a, hparams,
                lambda w: bpetok.add_vocab(w, tok, vocab_size(arch), specials), size_label=False,
                draw=lambda seed: draw_weights(body, seed, mlp=_experts(arch, tie)), layout=_layout(arch),
                save_pretrained=False)


def state_dict(arch: str, seed: int = 0, tie: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The weights under the hub's names, float32, drawn in a fixed order."""
    return spec(arch, tie).state_dict(seed)


def dequantized_state_dict(arch: str, quant: str | None, seed: int = 0, tie=None) -> dict[str, np.ndarray]:
    """state_dict() as `write_gguf(quant=...)` stores it: each matrix round-tripped through its quant
    type, but the routers (kept F32)."""
    return spec(arch, tie).dequantized(quant, seed, keep=(_names(arch)[0],))


def write_hf_dir(out: Path, arch: str, seed: int = 0, tie=None, quant: str | None = None) -> Path:
    """The Hugging Face directory; with `quant`, of the weights the GGUF of that quant type holds."""
    return spec(arch, tie).write_hf_dir(out, seed, weights=dequantized_state_dict(arch, quant, seed, tie))


hf_model = load_hf_dir  # transformers' model of the directory, float32, eager attention, eval mode


def write_gguf(path: Path, arch: str, quant: str | None = None, seed: int = 0, tie=None) -> Path:
    return spec(arch, tie).write_gguf(path, quant, seed)
