"""The config's feature flags, computed by the CPU kernels, against HF transformers (fp32, eager
attention) on tiny random-initialized models of the architectures that use them: Qwen3 (QK-norm, a
head_dim of its own), Gemma 3 (QK-norm, post-attention and post-FFN norms with Gemma's (1 + w),
GELU-tanh, sliding-window layers with their own RoPE base, a linearly scaled global RoPE, the attention
scale from query_pre_attn_scalar, embedding scale, final logit soft-capping), Gemma 2 (attention logit
soft-capping at a cap that binds, no QK-norm), SmolLM3 (a NoPE layer), Llama 3.1's RoPE scaling,
Mistral's sliding window. The checkpoints are built here from the HF state dicts (an
architecture's own spec, which reads such files, comes with it); what is checked is the kernels and the
config: logits within 1e-4 of transformers', the same greedy tokens, and the contract (threads,
chunking, a traced pass) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from tinydet.backends.cpu import CPUBackend
from tinydet.config import ModelConfig, RoPE
from tinydet.formats import Tensor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, DIM, LAYERS, HEADS, KV, HEAD_DIM, CTX = 256, 64, 3, 4, 2, 32, 256
PROMPTS = [list(np.random.default_rng(s).integers(0, VOCAB, n)) for s, n in ((1, 37), (2, 12), (3, 25))]


def _hf_model(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random, non-trivial weights everywhere (norms included)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.08))
    return model


def _canonical(sd: dict, gemma: bool) -> dict[str, Tensor]:
    """HF state dict -> canonical names; Gemma's norms scale by (1 + w), computed in float32 as it does."""
    f = {k: v.detach().numpy().astype(np.float32) for k, v in sd.items()}
    norm = (lambda w: np.float32(1.0) + w) if gemma else (lambda w: w)
    out = {"tok_embeddings": f["model.embed_tokens.weight"], "norm": norm(f["model.norm.weight"])}
    out["output"] = f.get("lm_head.weight", out["tok_embeddings"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                 "wo": "self_attn.o_proj.weight", "w1": "mlp.gate_proj.weight", "w2": "mlp.down_proj.weight",
                 "w3": "mlp.up_proj.weight"}
        out.update({f"layers.{i}.{c}": f[p + h] for c, h in names.items()})
        out[f"layers.{i}.attention_norm"] = norm(f[p + "input_layernorm.weight"])
        if gemma:
            out[f"layers.{i}.post_attention_norm"] = norm(f[p + "post_attention_layernorm.weight"])
            out[f"layers.{i}.ffn_norm"] = norm(f[p + "pre_feedforward_layernorm.weight"])
            out[f"layers.{i}.post_ffn_norm"] = norm(f[p + "post_feedforward_layernorm.weight"])
        else:
            out[f"layers.{i}.ffn_norm"] = f[p + "post_attention_layernorm.weight"]
        if p + "self_attn.q_norm.weight" in f:
            out[f"layers.{i}.q_norm"] = norm(f[p + "self_attn.q_norm.weight"])
            out[f"layers.{i}.k_norm"] = norm(f[p + "self_attn.k_norm.weight"])
    tied = out["output"] is out["tok_embeddings"]
    t = {k: Tensor.of(v) for k, v in out.items() if k != "output"}
    t["output"] = t["tok_embeddings"] if tied else Tensor.of(out["output"])
    return t


def _case(name):
    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, max_position_embeddings=CTX, rms_norm_eps=1e-6)
    base = dict(arch=name, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV, vocab_size=VOCAB,
                context_length=CTX, rms_eps=1e-6)
    if name == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, intermediate_size=128, head_dim=HEAD_DIM, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e6}))
        cfg = ModelConfig(**base, ffn_dim=128, head_dim=HEAD_DIM, rope=RoPE(1e6), qk_norm=True)
        return transformers.Qwen3ForCausalLM, hf.config, cfg, False
    if name == "gemma3":
        c = transformers.Gemma3TextConfig(
            **common, intermediate_size=96, head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
            final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
        local, glob = RoPE(10000.0), RoPE(1e6, scaling="linear", factor=2.0)
        cfg = ModelConfig(**base, ffn_dim=96, head_dim=HEAD_DIM, qk_norm=True, post_norms=True, activation="gelu_tanh",
                          layer_windows=(8, 8, 0), rope=glob, layer_ropes=(local, local, glob),
                          attn_scale=float(np.float32(24 ** -0.5)), embed_scale=float(np.float32(DIM ** 0.5)),
                          logit_softcap=3.0)
        return transformers.Gemma3ForCausalLM, c, cfg, True
    if name == "gemma2":
        c = transformers.Gemma2Config(
            **common, intermediate_size=96, head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=1.5, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")
        cfg = ModelConfig(**base, ffn_dim=96, head_dim=HEAD_DIM, post_norms=True, activation="gelu_tanh",
                          layer_windows=(8, 0, 8), attn_scale=float(np.float32(24 ** -0.5)),
                          embed_scale=float(np.float32(DIM ** 0.5)), attn_softcap=1.5, logit_softcap=3.0)
        return transformers.Gemma2ForCausalLM, c, cfg, True
    if name == "smollm3":
        c = transformers.SmolLM3Config(**common, intermediate_size=128, no_rope_layers=[1, 0, 1], rope_theta=5e6,
                                       tie_word_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2)
        cfg = ModelConfig(**base, ffn_dim=128, head_dim=DIM // HEADS, rope=RoPE(5e6), layer_nope=(False, True, False))
        return transformers.SmolLM3ForCausalLM, c, cfg, False
    if name == "llama3":
        rp = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        c = transformers.LlamaConfig(**common, intermediate_size=128, head_dim=HEAD_DIM, rope_parameters=rp)
        cfg = ModelConfig(**base, ffn_dim=128, head_dim=HEAD_DIM,
                          rope=RoPE(500000.0, "llama3", 8.0, 1.0, 4.0, 64))
        return transformers.LlamaForCausalLM, c, cfg, False
    if name == "mistral":
        c = transformers.MistralConfig(**common, intermediate_size=160, head_dim=DIM // HEADS, sliding_window=8)
        cfg = ModelConfig(**base, ffn_dim=160, head_dim=DIM // HEADS, layer_windows=(8,) * LAYERS)
        return transformers.MistralForCausalLM, c, cfg, False
    raise ValueError(name)


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "gemma2", "smollm3", "llama3", "mistral"])
def pair(request):
    cls, hf_config, cfg, gemma = _case(request.param)
    hf_config._attn_implementation = "eager"
    hf = _hf_model(cls, hf_config, seed=len(request.param))
    return request.param, hf, CPUBackend(cfg.validate("test"), _canonical(hf.state_dict(), gemma), "fp32", threads=2)


def _ours(be, ids, chunk=None):
    cache = be.new_cache(len(ids))
    step = chunk or len(ids)
    return np.concatenate([be.forward(ids[i:i + step], cache, all_logits=True) for i in range(0, len(ids), step)])


def test_logits_match_transformers(pair, record_property):
    name, hf, be = pair
    worst = 0.0
    for ids in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        got = _ours(be, ids)
        worst = max(worst, float(np.abs(got - want).max()))
    record_property(f"{name}_max_abs_diff", worst)
    print(f"{name}: max |tinydet - transformers| = {worst:.2e}")
    assert worst <= 1e-4, name


def test_greedy_tokens_match_transformers(pair):
    name, hf, be = pair
    ids = PROMPTS[1]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    cache = be.new_cache(len(ids) + 16)
    got, logits = [], be.forward(ids, cache)[0]
    for _ in range(16):
        got.append(int(np.argmax(logits)))
        logits = be.forward([got[-1]], cache)[0]
    assert got == want, name


def test_flags_keep_the_contract(pair):
    """Threads, chunk sizes (across the sliding window's edge) and a traced pass (fusions undone):
    the same bits."""
    name, _, be = pair
    ids = PROMPTS[0]
    base = _ours(be, ids).view(np.uint32)
    for threads, chunk in ((1, None), (3, 5), (2, 1), (1, 9)):
        be.threads = threads
        assert np.array_equal(_ours(be, ids, chunk).view(np.uint32), base), (name, threads, chunk)
    be.threads = 2
    ops = set()
    traced = be.forward_batch([(0, ids)], be.new_cache(len(ids)), all_logits=True,
                              hook=lambda layer, op, pos, slots, rows: ops.add(op))[0]
    assert np.array_equal(traced.view(np.uint32), base)
    if be.config.post_norms:
        assert {"post_attention_norm", "post_ffn_norm"} <= ops
