"""Tiny mixture-of-experts checkpoints made here, deterministically, for tests: Qwen3-MoE ("qwen3moe"),
Mixtral ("mixtral") and OLMoE ("olmoe"), the same random weights written as

* a Hugging Face directory (`write_hf_dir`): model.safetensors with the hub's names, one tensor per
  expert matrix (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`, as the
  published Qwen3-30B-A3B and Mixtral-8x7B repos store them; transformers 5 merges them at load),
  config.json in the hub's form, and the tokenizer files of `qwen2gen` (Qwen2's BPE for Qwen3-MoE,
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

import qwen2gen as Q
from tinygen import QUANTS, add_tensor, stored_values
from tinygen import write_json

HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2
EXPERTS, USED = 8, 2
CONTEXT = 512
RMS_EPS = 1e-6
ROUTER_STD = 0.6
ARCHS = {
    # arch: (head_dim, expert width, rope theta, tokenizer arch of qwen2gen)
    "qwen3moe": (32, 64, 1_000_000.0, "qwen2"),
    "mixtral": (HIDDEN // HEADS, 96, 1_000_000.0, "llama3"),
    "olmoe": (HIDDEN // HEADS, 64, 10_000.0, "llama3"),
}


def vocab_size(arch: str) -> int:
    """The tokenizer's size: the embedding is not padded past it (a padded row's token could be sampled,
    and a tokenizer cannot decode it)."""
    tj = Q.tokenizer_json(ARCHS[arch][3])
    return 1 + max(list(tj["model"]["vocab"].values()) + [t["id"] for t in tj["added_tokens"]])


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
                 bos_token_id=Q.token_id("<|begin_of_text|>", tok), eos_token_id=Q.token_id("<|eot_id|>", tok))
    elif arch == "mixtral":
        c.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=ffn,
                 num_local_experts=EXPERTS, sliding_window=None, router_jitter_noise=0.0,
                 bos_token_id=Q.token_id("<|begin_of_text|>", tok), eos_token_id=Q.token_id("<|eot_id|>", tok))
    else:
        c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=4 * ffn,
                 moe_intermediate_size=ffn, num_experts=EXPERTS, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], head_dim=hd, attention_bias=False, use_sliding_window=False,
                 sliding_window=None, max_window_layers=LAYERS, bos_token_id=Q.token_id("<|endoftext|>"),
                 eos_token_id=Q.token_id("<|im_end|>"))
    return dict(sorted(c.items()))


def state_dict(arch: str, seed: int = 0, tie: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The weights under the hub's names, float32, drawn in a fixed order."""
    hd, ffn, _, _ = ARCHS[arch]
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    def norm(n=HIDDEN):
        return (1.0 + rs.standard_normal(n) * 0.1).astype(np.float32)

    router, experts, (g, d, u) = _names(arch)
    q, kv = HEADS * hd, KV_HEADS * hd
    V = vocab_size(arch)
    sd = {"model.embed_tokens.weight": normal((V, HIDDEN), 0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            sd[p + f"self_attn.{x}_proj.weight"] = normal((rows, HIDDEN), 0.08)
        if arch == "qwen3moe":
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        if arch == "olmoe":  # over the whole of q and of k
            sd[p + "self_attn.q_norm.weight"] = norm(q)
            sd[p + "self_attn.k_norm.weight"] = norm(kv)
        sd[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), 0.08)
        sd[p + "post_attention_layernorm.weight"] = norm()
        r = normal((EXPERTS, HIDDEN), ROUTER_STD)
        if tie is not None and i == 0:
            r[tie[1]] = r[tie[0]]
        sd[p + router + ".weight"] = r
        for e in range(EXPERTS):
            sd[p + f"{experts}.{e}.{g}.weight"] = normal((ffn, HIDDEN), 0.1)
            sd[p + f"{experts}.{e}.{u}.weight"] = normal((ffn, HIDDEN), 0.1)
            sd[p + f"{experts}.{e}.{d}.weight"] = normal((HIDDEN, ffn), 0.1)
    sd["model.norm.weight"] = norm()
    sd["lm_head.weight"] = normal((V, HIDDEN), 0.2)
    return sd


def dequantized_state_dict(arch: str, quant: str | None, seed: int = 0, tie=None) -> dict[str, np.ndarray]:
    """state_dict() as `write_gguf(quant=...)` stores it: each matrix round-tripped through its quant
    type, but the routers (kept F32)."""
    router = _names(arch)[0]
    return {k: v if router in k else stored_values(v, quant) for k, v in state_dict(arch, seed, tie).items()}


def write_hf_dir(out: Path, arch: str, seed: int = 0, tie=None, quant: str | None = None) -> Path:
    """The Hugging Face directory; with `quant`, of the weights the GGUF of that quant type holds."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = dequantized_state_dict(arch, quant, seed, tie)
    save_file({k: sd[k] for k in sorted(sd)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config_json(arch))
    c = config_json(arch)
    write_json(out / "generation_config.json", {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]})
    Q.write_tokenizer_files(out, ARCHS[arch][3])
    return out


def hf_model(hf_dir: Path):
    """transformers' model of the directory, float32, eager attention, eval mode."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()


def write_gguf(path: Path, arch: str, quant: str | None = None, seed: int = 0, tie=None) -> Path:
    import gguf
    from gguf import GGUFWriter, LlamaFileType

    hd, ffn, theta, tok = ARCHS[arch]
    llama = arch == "mixtral"
    gguf_arch = {"mixtral": "llama"}.get(arch, arch)
    path = Path(path)
    sd = state_dict(arch, seed, tie)
    router, experts, (g, d, u) = _names(arch)
    w = GGUFWriter(path, gguf_arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"Tiny {arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(4 * ffn if arch == "qwen3moe" else ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    if arch == "qwen3moe":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_feed_forward_length(ffn)
    w.add_file_type(LlamaFileType[QUANTS[quant][1]])
    if llama:
        w.add_vocab_size(vocab_size(arch))
        w.add_rope_dimension_count(hd)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, toktypes, merges = Q.gguf_vocab(tok)
    tokens, toktypes = tokens[:vocab_size(arch)], toktypes[:vocab_size(arch)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if tok == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    c = config_json(arch)
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_add_bos_token(tok == "llama3")
    w.add_chat_template(Q.LLAMA3_CHAT_TEMPLATE if tok == "llama3" else Q.CHAT_TEMPLATE)

    add_tensor(w, "token_embd.weight", sd["model.embed_tokens.weight"], quant)
    add_tensor(w, "output_norm.weight", sd["model.norm.weight"], quant)
    add_tensor(w, "output.weight", sd["lm_head.weight"], quant)
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                       ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                       ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                       ("post_attention_layernorm", "ffn_norm")):
            if p + hf + ".weight" not in sd:
                continue
            a = sd[p + hf + ".weight"]
            if llama and gg in ("attn_q", "attn_k"):
                a = Q.llama_permute(a, HEADS if gg == "attn_q" else KV_HEADS)
            add_tensor(w, b + gg + ".weight", a, quant)
        add_tensor(w, b + "ffn_gate_inp.weight", sd[p + router + ".weight"], None)  # kept F32
        for name, gg in ((g, "ffn_gate_exps"), (d, "ffn_down_exps"), (u, "ffn_up_exps")):
            stack = np.stack([sd[p + f"{experts}.{e}.{name}.weight"] for e in range(EXPERTS)])
            add_tensor(w, b + gg + ".weight", stack, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make(out: Path, arch: str, quant: str | None = None, seed: int = 0, tie=None) -> tuple[Path, Path]:
    """(hf_dir, gguf) under out."""
    out = Path(out)
    stem = f"tiny-{arch}" + (f"-s{seed}" if seed else "") + ("-tie" if tie else "")
    return (write_hf_dir(out / stem, arch, seed, tie),
            write_gguf(out / f"{stem}-{QUANTS[quant][0]}.gguf", arch, quant, seed, tie))
