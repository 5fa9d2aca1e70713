"""The scaffold every tiny-checkpoint generator plugs into (qwen2gen, spmgen, gemma3gen, gemma2gen,
smollm3gen, moegen, gptossgen). An architecture is a `Tiny` spec: its `Body` (shapes, the scales its
random weights are drawn at, which tensors it has), config.json and generation_config.json as its
hub repos have them, the GGUF keys and tensor names in its converter's order, its tokenizer (bpetok,
gemmatok, llama2tok) and its quirks (llama.cpp's permuted Q/K rows, Gemma's 1 + w norms, a GGUF
layout of its own). From that, this module draws the weights, builds transformers' model of them,
and writes the Hugging Face directory and the GGUF as llama.cpp's convert_hf_to_gguf.py does.

A new architecture is a module that builds its Tiny (see gemma2gen, the smallest), and a test module
that takes archrunner's fixtures and checks.

Everything is written deterministically: the same call writes byte-identical files on any machine
(weights from `np.random.RandomState`, whose stream NumPy keeps stable, drawn in a fixed order; JSON
written here, not by a library whose format may change). Golden hashes (tests/golden/*.json) pin
some of these files, so a change here that moves a byte is a change to those tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


def write_json(path: Path, obj) -> None:
    """JSON as the generators write every file: indented, UTF-8, LF line ends, a final newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8", newline="\n")


def with_changes(c: dict, changes: dict) -> dict:
    """`c` with `changes` applied; a change to None removes the key (a variant's config.json)."""
    c = dict(c)
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def file_digests(paths) -> dict[str, str]:
    """name -> SHA-256 of each file (directories: each file inside), for determinism checks."""
    out = {}
    for p in map(Path, paths):
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            out[os.path.relpath(f, p.parent)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------------------------------------------
# Quant types: the names of the converter's --outtype

# quant name -> (GGMLQuantizationType name, LlamaFileType name)
QUANTS = {
    None: ("F32", "ALL_F32"),
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    # llama.cpp's converter stores only MoE experts as MXFP4 (gpt-oss); here any matrix may be, to test
    # the type on every kind of matrix
    "mxfp4": ("MXFP4", "MOSTLY_MXFP4_MOE"),
}


def qtype(quant: str | None):
    """The GGMLQuantizationType of a quant name."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[QUANTS[quant][0]]


def file_type(quant: str | None) -> int:
    """general.file_type of a file whose matrices are `quant`."""
    from gguf import LlamaFileType

    return int(LlamaFileType[QUANTS[quant][1]])


def add_tensor(w, gname: str, arr: np.ndarray, quant: str | None) -> None:
    """Add `arr` to GGUFWriter `w` as the converter stores it for `quant`: 1-D tensors F32, matrices
    F32, F16 or quantized by gguf-py."""
    from gguf import GGMLQuantizationType, quants

    t = qtype(quant)
    if arr.ndim == 1 or t == GGMLQuantizationType.F32:
        w.add_tensor(gname, arr)
    elif t == GGMLQuantizationType.F16:
        w.add_tensor(gname, arr.astype(np.float16))
    else:
        w.add_tensor(gname, quants.quantize(arr, t), raw_dtype=t)


def stored_values(arr: np.ndarray, quant: str | None) -> np.ndarray:
    """The float32 values a reader gets back from what `add_tensor` stores for `arr`."""
    from gguf import GGMLQuantizationType, quants

    t = qtype(quant)
    if arr.ndim == 1 or t == GGMLQuantizationType.F32:
        return arr
    if t == GGMLQuantizationType.F16:
        return arr.astype(np.float16).astype(np.float32)
    return quants.dequantize(quants.quantize(arr, t), t).astype(np.float32)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from HF's rotate-half order to adjacent pairs,
    as the converter stores a llama Q (n_head = heads) or K (n_head = KV heads)."""
    return np.ascontiguousarray(w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


def gguf_name(hf_name: str, names: dict[str, str]) -> str:
    """A GGUF tensor name: `names` maps whole HF names and the suffixes after model.layers.N."""
    if hf_name in names:
        return names[hf_name]
    parts = hf_name.split(".")  # model.layers.N.rest
    return f"blk.{parts[2]}." + names[".".join(parts[3:])]


# gguf-py's tensor map for the llama-like architectures (llama.cpp's converter's names), and Gemma's
# sandwich norms; a spec passes its own where it differs.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # [gate; up], llama.cpp's fused SwiGLU input
    "mlp.down_proj.weight": "ffn_down.weight",
}
GEMMA_GGUF_NAMES = {**GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                    "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def add_overrides(w, overrides: dict) -> None:
    """Write and remove the keys of `overrides` that are not tokenizer keys (a test's broken files):
    ints as uint32, floats as float32, strings as strings."""
    for key in [k for k in overrides if not k.startswith("tokenizer.")]:
        v = overrides.pop(key)
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TypeError(f"{key}: an int, float or str override, found {v!r}")
        _add_kv(w, key, v, v)


def _add_kv(w, key: str, value, like) -> None:
    """A hyperparameter typed as the converter's adder types it: int -> uint32, float -> float32."""
    add = w.add_uint32 if isinstance(like, int) else w.add_float32 if isinstance(like, float) else w.add_string
    add(key, value)


def gguf_file(path: Path, arch: str, name: str, hparams: dict, vocab: Callable, tensors: list,
              n_params: int | None = None, overrides: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A GGUF in the converter's order: general.type, .name and .size_label (of `n_params`, as the
    converter computes it; None: left out), `hparams` (full keys in order, general.file_type among
    them), the quantization version, the vocabulary (`vocab(writer)`), then `tensors` ((GGUF name,
    float32 array, quant) each). Alignment 32, gguf-py's default.

    For files that are wrong on purpose: `overrides` maps a metadata key to the value written instead of
    the converter's (a key it does not write is added after the hyperparameters: int -> uint32, float
    -> float32, str -> string); `drop` names tensors left out. Returns path."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides or {})
    w = gguf.GGUFWriter(path, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    if n_params is not None:
        w.add_size_label(gguf.size_label(n_params, n_params, 0, 0))
    for key, value in hparams.items():
        _add_kv(w, key, overrides.pop(key, value), value)
    add_overrides(w, overrides)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab(w)
    if overrides:
        raise KeyError(f"overrides for keys write_gguf does not write: {sorted(overrides)}")
    for gname, arr, quant in tensors:
        if gname not in drop:
            add_tensor(w, gname, arr, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------
# The model

@dataclass(frozen=True)
class Body:
    """A tiny decoder's shapes, which tensors it has, and the scales its weights are drawn at."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int  # the embedding's rows
    tied: bool = False
    embed_std: float = 0.1
    matrix_std: float = 0.08
    norm_std: float = 0.1
    norm_one: bool = True  # norms 1 + std N(0, 1); Gemma's are w = std N(0, 1), the model scales by 1 + w
    lm_head_std: float | None = 0.2  # drawn even when tied (so the others do not move); None: never drawn
    bias_std: float | None = None  # q/k/v biases (Qwen2, gpt-oss)
    qk_norm: str | None = None  # "head": a weight of head_dim (Qwen3, Gemma 3); "all": over all of q, k (OLMoE)
    fused: bool = False  # Phi-3's qkv_proj and gate_up_proj
    sandwich: bool = False  # Gemma's pre- and post-feed-forward norms

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def draw_weights(b: Body, seed: int = 0, attn_out: Callable | None = None,
                 mlp: Callable | None = None) -> dict[str, np.ndarray]:
    """The weights under transformers' names, float32, drawn in this fixed order. `attn_out(prefix,
    normal)` draws what follows o_proj (gpt-oss's bias and sinks); `mlp(prefix, layer, normal)` draws
    a layer's feed-forward block in place of the dense one (mixtures of experts)."""
    rs = np.random.RandomState(seed)

    def normal(shape, std):
        return (rs.standard_normal(shape) * std).astype(np.float32)

    def norm(n=b.hidden):
        w = rs.standard_normal(n) * b.norm_std
        return ((1.0 + w) if b.norm_one else w).astype(np.float32)

    h, q, kv = b.hidden, b.q_dim, b.kv_dim
    sd = {"model.embed_tokens.weight": normal((b.vocab, h), b.embed_std)}
    for i in range(b.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        if b.fused:
            sd[p + "self_attn.qkv_proj.weight"] = normal((q + 2 * kv, h), b.matrix_std)
        else:
            for x, rows in (("q", q), ("k", kv), ("v", kv)):
                sd[p + f"self_attn.{x}_proj.weight"] = normal((rows, h), b.matrix_std)
                if b.bias_std is not None:
                    sd[p + f"self_attn.{x}_proj.bias"] = normal((rows,), b.bias_std)
        if b.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(b.head_dim if b.qk_norm == "head" else q)
            sd[p + "self_attn.k_norm.weight"] = norm(b.head_dim if b.qk_norm == "head" else kv)
        sd[p + "self_attn.o_proj.weight"] = normal((h, q), b.matrix_std)
        sd.update(attn_out(p, normal) if attn_out else {})
        sd[p + "post_attention_layernorm.weight"] = norm()
        if b.sandwich:
            sd[p + "pre_feedforward_layernorm.weight"] = norm()
        if mlp:
            sd.update(mlp(p, i, normal))
        elif b.fused:
            sd[p + "mlp.gate_up_proj.weight"] = normal((2 * b.ffn, h), b.matrix_std)
        else:
            sd[p + "mlp.gate_proj.weight"] = normal((b.ffn, h), b.matrix_std)
            sd[p + "mlp.up_proj.weight"] = normal((b.ffn, h), b.matrix_std)
        if not mlp:
            sd[p + "mlp.down_proj.weight"] = normal((h, b.ffn), b.matrix_std)
        if b.sandwich:
            sd[p + "post_feedforward_layernorm.weight"] = norm()
    sd["model.norm.weight"] = norm()
    if b.lm_head_std is not None:
        lm_head = normal((b.vocab, h), b.lm_head_std)
        if not b.tied:
            sd["lm_head.weight"] = lm_head
    return sd


_NOT_CONFIG = ("architectures", "model_type", "torch_dtype", "_sliding_window_pattern")


def hf_model(config: dict, weights: dict, attn: str | None = "eager"):
    """transformers' model of config.json `config` (its `architectures` class, float32, eval mode,
    `attn` attention: eager, whose masks apply a sliding window as every implementation does; None:
    transformers' default) holding `weights`; raises where the names do not fit or a model without
    lm_head.weight is not tied."""
    import torch
    import transformers

    config = json.loads(json.dumps(config))  # a copy: transformers rewrites rope_scaling in place
    cls = getattr(transformers, config["architectures"][0])
    cfg = cls.config_class(**{k: v for k, v in config.items() if k not in _NOT_CONFIG})
    if attn is not None:
        cfg._attn_implementation = attn
    model = cls(cfg).to(torch.float32)
    tied = "lm_head.weight" not in weights
    sd = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")
    return model.eval()


def load_hf_dir(hf_dir: Path):
    """transformers' model of a directory, float32, eager attention, eval mode."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()


# ---------------------------------------------------------------------------------------------------
# The spec

@dataclass(frozen=True)
class Tiny:
    """One tiny architecture (one variant of it: tied or not, a head_dim of its own, ...)."""

    stem: str  # files: tiny-{stem}[-sN]/ and tiny-{stem}[-sN]-<F32|Q8_0|...>.gguf
    title: str  # GGUF general.name: "Tiny {title}" (+ " S{seed}"), as the converter names make()'s files
    body: Body
    config: dict  # config.json in the hub's form (transformers 4.x keys)
    generation: dict  # generation_config.json
    tokenizer: Callable  # writes the tokenizer files into a directory
    gguf_arch: str  # general.architecture
    hparams: dict  # the converter's hyperparameter keys in its order; general.file_type None: the quant's
    vocab: Callable  # adds the vocabulary keys to a GGUFWriter
    gguf_names: dict = dataclasses.field(default_factory=lambda: GGUF_NAMES)
    permute: bool = False  # llama.cpp's interleaved RoPE: Q/K rows permuted (LlamaModel.modify_tensors)
    norm_offset: bool = False  # Gemma: norm weights stored as 1 + w (in float32, one rounding)
    size_label: bool = True
    attn: str | None = "eager"  # transformers' attention implementation for the reference
    extra: Callable | None = None  # () -> {name: array} written first (generate_extra_tensors')
    draw: Callable | None = None  # seed -> weights, for a body draw_weights does not cover
    layout: Callable | None = None  # (weights, quant) -> GGUF tensors, for a layout of its own
    save_pretrained: bool = True  # model.safetensors by save_pretrained, else by safetensors (hub layout)

    def state_dict(self, seed: int = 0) -> dict[str, np.ndarray]:
        return self.draw(seed) if self.draw else draw_weights(self.body, seed)

    def dequantized(self, quant: str | None, seed: int = 0, keep=()) -> dict[str, np.ndarray]:
        """state_dict() with each matrix round-tripped through what the GGUF stores for it (the float
        weights a quantized file holds; names with a part in `keep` stay as drawn: stored F32)."""
        sd = self.state_dict(seed)
        return {k: v if any(s in k for s in keep) else stored_values(v, quant) for k, v in sd.items()}

    def hf_model(self, seed: int = 0, weights: dict | None = None, config: dict | None = None,
                 attn: str | None = None):
        return hf_model(config or self.config, weights or self.state_dict(seed), attn or self.attn)

    def write_hf_dir(self, hf_dir: Path, seed: int = 0, config: dict | None = None,
                     weights: dict | None = None) -> Path:
        """model.safetensors, config.json (`config`, or the spec's), generation_config.json and the
        tokenizer files. Returns hf_dir."""
        hf_dir = Path(hf_dir)
        hf_dir.mkdir(parents=True, exist_ok=True)
        if self.save_pretrained:
            self.hf_model(seed, weights).save_pretrained(hf_dir, safe_serialization=True)
        else:
            from safetensors.numpy import save_file

            sd = weights if weights is not None else self.state_dict(seed)
            save_file({k: sd[k] for k in sorted(sd)}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        # save_pretrained's JSON carries its transformers version and that version's key names: write the
        # hub's form instead, so the bytes depend on nothing installed.
        write_json(hf_dir / "config.json", config or self.config)
        write_json(hf_dir / "generation_config.json", self.generation)
        self.tokenizer(hf_dir)
        return hf_dir

    def gguf_tensors(self, weights: dict, quant: str | None) -> list:
        """(GGUF name, array, quant) in the order llama.cpp's converter writes them: it walks the
        safetensors file, whose tensors are sorted by name (blk.1 before blk.10: fine for the few
        layers here)."""
        if self.layout:
            return self.layout(weights, quant)
        b, out = self.body, []
        for hf_name in sorted(weights):
            arr = weights[hf_name]
            if self.permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                arr = llama_permute(arr, b.heads if "q_proj" in hf_name else b.kv_heads)
            if self.norm_offset and hf_name.endswith("norm.weight"):
                arr = (np.float32(1.0) + np.asarray(arr, np.float32)).astype(np.float32)
            out.append((gguf_name(hf_name, self.gguf_names), arr, quant))
        return out

    def write_gguf(self, path: Path, quant: str | None = None, seed: int = 0, name: str | None = None,
                   overrides: dict | None = None, drop: tuple[str, ...] = (), extra: dict | None = None,
                   weights: dict | None = None) -> Path:
        """The same model as llama.cpp's converter writes it; quant: None/"f32" (all F32), or one of
        QUANTS for every 2-D matrix (token_embd and output included, as --outtype does); 1-D tensors
        stay F32. name: general.name. `extra` (name -> float32 array) is written first, as the
        converter writes generate_extra_tensors'. `overrides`, `drop`: `gguf_file`."""
        sd = weights if weights is not None else self.state_dict(seed)
        extra = extra if extra is not None else self.extra() if self.extra else {}
        tensors = [(k, np.asarray(v, np.float32), None) for k, v in extra.items()]
        tensors += self.gguf_tensors(sd, quant)
        hp = {k: file_type(quant) if v is None else v for k, v in self.hparams.items()}
        title = f"Tiny {self.title}" + (f" S{seed}" if seed else "")
        n_params = sum(v.size for v in sd.values()) if self.size_label else None
        return gguf_file(path, self.gguf_arch, name or title, hp, self.vocab, tensors, n_params, overrides, drop)

    def make(self, out_dir: Path, quant: str | None = None, seed: int = 0) -> tuple[Path, Path]:
        """Both forms under out_dir -> (hf_dir, gguf_path)."""
        stem = f"tiny-{self.stem}" + (f"-s{seed}" if seed else "")
        hf_dir = self.write_hf_dir(Path(out_dir) / stem, seed)
        return hf_dir, self.write_gguf(Path(out_dir) / f"{stem}-{QUANTS[quant][0]}.gguf", quant, seed)


