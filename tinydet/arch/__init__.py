"""Architectures as data: one `ArchSpec` per module of this package, found by name.

A spec says which tensors the architecture has in each format (canonical name, GGUF name, HF name,
shape, and the flag that makes an optional one exist), the load-time fix-ups it needs (GGUF rows of
Q/K in llama.cpp's interleaved RoPE order, an output matrix tied to the embedding), the feature flags
it sets in `ModelConfig`, and which settings of a file it accepts. The format readers (`formats/`)
read a file through its spec; the kernels see only the config's flags. Adding an architecture is
adding a module here that defines `SPEC`.

Canonical tensor names (HF's layout: Q/K rows in rotate-half order, matrices [out, in]):
  tok_embeddings [vocab, dim], norm [dim], output [vocab, dim],
  layers.{i}.attention_norm [dim], .wq [q_dim, dim], .wk [kv_dim, dim], .wv [kv_dim, dim],
  .wo [dim, q_dim], .ffn_norm [dim], .w1 (gate) [ffn, dim], .w2 (down) [dim, ffn], .w3 (up) [ffn, dim],
  and where the flags call for them: .bq [q_dim], .bk / .bv [kv_dim] (qkv_bias), .q_norm / .k_norm
  [head_dim] (qk_norm), .post_attention_norm / .post_ffn_norm [dim] (post_norms).
Model code never sees a GGUF or HF name. A tensor's canonical value is what the kernels use; where
an HF file stores it offset (Gemma's norms: w for 1 + w, which GGUF stores as is), its TensorSpec says
so (`hf_offset`) and the HF reader and writer apply it. Where a file stores several canonical tensors
as the rows of one (Phi-3's qkv_proj [wq; wk; wv] and gate_up_proj [w1; w3]), each part's TensorSpec
names the stored tensor and says which rows are its own (`fused`, `part`): `ArchSpec.gather` finds the
stored tensor once and gives each part a row slice of its bytes (`formats.Tensor.row_slice`), and the
convert tool writes the parts back concatenated in order. The canonical names stay wq/wk/wv/w1/w3.

A mixture-of-experts FFN (`ModelConfig.n_experts`) has, per layer, the router `.router [n_experts,
dim]` and each expert's matrices `.experts.{e}.w1` / `.w2` / `.w3` (shapes as the dense ones, ffn_dim
the expert's width). Their TensorSpecs say `experts`: the canonical and HF names take the expert index
after the layer's (Hugging Face checkpoints store each expert's matrices apart), while GGUF stores all
of a layer's experts as one 3-D tensor (`ffn_gate_exps` [n_experts, ffn, dim]), found once, each expert
a view of its bytes (`formats.Tensor.expert`). gpt-oss's Hugging Face files store them as GGUF does,
one tensor per layer, each expert's matrix transposed and gate and up interleaved (`hf_stacked`).

A spec whose `gguf_arch` is None is read from Hugging Face directories only: llama.cpp's converter
writes that architecture under another one's name (Mistral as `llama`), so its GGUF files are that
spec's.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..config import ModelConfig


def short(v) -> str:
    """A file's value for a one-line message, as the format readers and the specs' hooks refuse it: an
    array (which can hold millions of elements) by its length, anything else by a repr of at most 80
    characters."""
    if isinstance(v, (list, np.ndarray)):
        return f"an array of {len(v)} elements"
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


@dataclass(frozen=True)
class TensorSpec:
    canonical: str  # "layers.{}.wq": {} is the layer index
    gguf: str  # "blk.{}.attn_q.weight"
    hf: str  # "model.layers.{}.self_attn.q_proj.weight"
    shape: tuple[str, ...]  # ModelConfig attributes, numpy order: ("q_dim", "dim")
    flag: str | None = None  # the tensor exists exactly when this config flag is on (None: always)
    rope_rows: str | None = None  # "q" or "k": rows that llama.cpp's converter permutes for its RoPE
    # The HF file stores the value minus this (Gemma's norm weights: w, for a scale of 1 + w): reading an
    # HF directory gives float32(hf_offset + stored), writing one (convert) float32(value - hf_offset).
    hf_offset: float = 0.0
    # Rows of a fused stored tensor: `fused` lists the ModelConfig attributes giving the row counts of
    # the parts in stored order (("q_dim", "kv_dim", "kv_dim") for Phi-3's qkv_proj), `part` is this
    # tensor's index among them. Every part has the same gguf / hf name; the stored tensor has
    # (sum of the parts' rows,) + shape[1:] elements.
    fused: tuple[str, ...] = ()
    part: int = 0
    experts: bool = False  # one tensor per expert (module docstring): names take "{}" for layer, expert
    # An expert tensor that Hugging Face stores, like GGUF, as one tensor of every expert's per layer
    # (gpt-oss: names take "{}" for the layer only), each expert's [in, out] (`hf_transposed`) where
    # the canonical matrix is [out, in], and with `hf_interleave` 0 or 1 this tensor being the even or
    # odd rows of that (columns as stored, elements of a vector) of two canonical tensors interleaved.
    hf_stacked: bool = False
    hf_transposed: bool = False
    hf_interleave: int | None = None

    def __post_init__(self):
        if self.fused and not (0 <= self.part < len(self.fused) and self.fused[self.part] == self.shape[0]):
            raise ValueError(f"{self.canonical}: part {self.part} of {self.fused} does not have {self.shape[0]} rows")

    def shape_for(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(getattr(cfg, s) for s in self.shape)

    def stored_shape(self, cfg: ModelConfig, fmt: str = "hf") -> tuple[int, ...]:
        """The shape of the tensor the file stores (the fused whole, for a part of one; every expert's,
        for an expert's matrix in GGUF)."""
        shape = self.shape_for(cfg)
        if self.experts and fmt == "hf" and self.hf_stacked:
            if self.hf_transposed:
                shape = shape[::-1]
            if self.hf_interleave is not None:
                shape = shape[:-1] + (2 * shape[-1],)
            return (cfg.n_experts,) + shape
        if self.experts and fmt == "gguf":
            return (cfg.n_experts,) + shape
        if not self.fused:
            return shape
        return (sum(getattr(cfg, s) for s in self.fused),) + shape[1:]

    def stored_rows(self, cfg: ModelConfig) -> tuple[int, int]:
        """Rows r0..r1 of the stored tensor that are this tensor (all of them, unless fused)."""
        if not self.fused:
            return 0, self.shape_for(cfg)[0]
        sizes = [getattr(cfg, s) for s in self.fused]
        r0 = sum(sizes[:self.part])
        return r0, r0 + sizes[self.part]


@dataclass(frozen=True)
class ArchSpec:
    name: str  # tinydet's name, ModelConfig.arch
    gguf_arch: str | None  # general.architecture; None: read from HF directories only (module docstring)
    hf_architectures: tuple[str, ...]  # config.json "architectures" entries that mean this spec
    hf_model_type: str  # config.json "model_type"
    tensors: tuple[TensorSpec, ...]
    flags: dict = field(default_factory=dict)  # ModelConfig flags the architecture always sets
    gguf_rope_permuted: bool = False  # GGUF stores Q/K rows permuted (undone at load, rows only move)
    own_head_dim: bool = False  # head_dim may differ from dim / n_heads
    hf_activations: tuple[str, ...] = ("silu",)  # config.json hidden_act values accepted
    rope_scalings: tuple[str, ...] = ("none",)  # RoPE scalings accepted from a file
    # Optional hooks for settings beyond the common keys: (reader, fields) -> fields, where `reader`
    # gives typed access to the file's keys and raises ModelFormatError naming them.
    gguf_config: Callable | None = None
    hf_config: Callable | None = None
    # The architecture's own config.json keys when writing a Hugging Face directory (convert).
    hf_config_out: Callable[[ModelConfig], dict] | None = None
    # The spec whose Hugging Face directories hold this architecture's mixture-of-experts files, where
    # another (llama's: Mixtral, which llama.cpp's converter writes as `llama`).
    hf_moe_spec: str | None = None
    gguf_yarn: bool = False  # a GGUF's rope.scaling.type "yarn" is the `gguf_config` hook's to read

    def tensors_for(self, cfg: ModelConfig) -> Iterator[tuple[str, TensorSpec, tuple[int, ...]]]:
        """(canonical name, spec, indices) for every tensor a model with `cfg` has, kind by kind, layer
        by layer within a kind (and expert by expert within a layer); indices are what the names'
        "{}" take: (), (layer,) or (layer, expert)."""
        for t in self.tensors:
            if t.flag is not None and not getattr(cfg, t.flag):
                continue
            if t.experts:
                for i in range(cfg.n_layers):
                    for e in range(cfg.n_experts):
                        yield t.canonical.format(i, e), t, (i, e)
            elif "{}" in t.canonical:
                for i in range(cfg.n_layers):
                    yield t.canonical.format(i), t, (i,)
            else:
                yield t.canonical, t, ()

    def gather(self, cfg: ModelConfig, fmt: str, find: Callable, progress: Callable | None = None) -> dict:
        """Every tensor of a model with `cfg`, under its canonical name: `find(canonical, name in the
        file, expected stored shape, TensorSpec)` (`fmt` "gguf" or "hf" picks the name) returns the
        file's tensor, or None for an absent output matrix, which is then the embedding's (the same
        object); it raises for anything else that is wrong. A fused stored tensor is found once, with
        its whole shape, and each part is its row slice. `progress(done, total, name)` is called
        before each tensor and once at the end."""
        names = [(canon, getattr(t, fmt).format(*idx), t, idx) for canon, t, idx in self.tensors_for(cfg)]
        out, stored = {}, {}  # stored: name in the file -> what find returned
        for done, (canon, name, t, idx) in enumerate(names):
            if progress is not None:
                progress(done, len(names), name)
            if name not in stored:
                stored[name] = find(canon, name, t.stored_shape(cfg, fmt), t)
            tensor = stored[name]
            if tensor is not None and t.fused:
                tensor = tensor.row_slice(*t.stored_rows(cfg))
            if tensor is not None and t.experts and fmt == "gguf":
                tensor = tensor.expert(idx[1])
            elif tensor is not None and t.experts and t.hf_stacked:
                tensor = tensor.expert(idx[1], t.hf_transposed, t.hf_interleave)
            if tensor is not None:
                out[canon] = tensor
        if TIED[0] not in out:
            out[TIED[0]] = out[TIED[1]]
        if progress is not None:
            progress(len(names), len(names), "")
        return out


def _T(canonical, gguf, hf, shape, **kw) -> TensorSpec:
    return TensorSpec(canonical, gguf, hf, shape, **kw)


# The tensors of a Llama model; other specs extend or change this list.
LLAMA_TENSORS = (
    _T("tok_embeddings", "token_embd.weight", "model.embed_tokens.weight", ("vocab_size", "dim")),
    _T("norm", "output_norm.weight", "model.norm.weight", ("dim",)),
    _T("output", "output.weight", "lm_head.weight", ("vocab_size", "dim")),  # absent: tied to tok_embeddings
    _T("layers.{}.attention_norm", "blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight", ("dim",)),
    _T("layers.{}.wq", "blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight", ("q_dim", "dim"),
       rope_rows="q"),
    _T("layers.{}.wk", "blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight", ("kv_dim", "dim"),
       rope_rows="k"),
    _T("layers.{}.wv", "blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight", ("kv_dim", "dim")),
    _T("layers.{}.wo", "blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight", ("dim", "q_dim")),
    _T("layers.{}.ffn_norm", "blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight", ("dim",)),
    _T("layers.{}.w1", "blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight", ("ffn_dim", "dim"),
       flag="dense_ffn"),
    _T("layers.{}.w2", "blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight", ("dim", "ffn_dim"),
       flag="dense_ffn"),
    _T("layers.{}.w3", "blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight", ("ffn_dim", "dim"),
       flag="dense_ffn"),
)


def moe_tensors(hf_router: str, hf_expert: str,
                names: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")) -> tuple[TensorSpec, ...]:
    """A mixture-of-experts FFN's tensors (module docstring): the router ("model.layers.{}." +
    `hf_router`, GGUF ffn_gate_inp) and each expert's w1, w2, w3 (HF: "model.layers.{}." + `hf_expert`
    + ".{}." + the name of w1, w2, w3 in `names`; GGUF ffn_{gate,down,up}_exps)."""
    L = "model.layers.{}."
    shapes = {"w1": ("ffn_dim", "dim"), "w2": ("dim", "ffn_dim"), "w3": ("ffn_dim", "dim")}
    return (_T("layers.{}.router", "blk.{}.ffn_gate_inp.weight", L + hf_router + ".weight", ("n_experts", "dim"),
               flag="n_experts"),) + tuple(
        _T(f"layers.{{}}.experts.{{}}.{w}", f"blk.{{}}.ffn_{g}_exps.weight", L + hf_expert + ".{}." + n + ".weight",
           shapes[w], flag="n_experts", experts=True)
        for w, g, n in zip(("w1", "w2", "w3"), ("gate", "down", "up"), names))


LLAMA_ATTENTION = LLAMA_TENSORS[:9]  # the embedding, norms and attention: Llama's tensors before its FFN's


TIED = ("output", "tok_embeddings")  # an absent output matrix is the embedding table


def _discover() -> dict[str, ArchSpec]:
    specs = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        spec = getattr(importlib.import_module(f"{__name__}.{m.name}"), "SPEC", None)
        if isinstance(spec, ArchSpec):
            specs[spec.name] = spec
    return specs


SPECS: dict[str, ArchSpec] = _discover()


def by_gguf(arch: str) -> ArchSpec | None:
    """The spec of a GGUF file's general.architecture (never an HF-only spec)."""
    return next((s for s in SPECS.values() if s.gguf_arch is not None and s.gguf_arch == arch), None)


def gguf_archs() -> list[str]:
    """The GGUF architectures tinydet reads, in spec order."""
    return [s.gguf_arch for s in SPECS.values() if s.gguf_arch is not None]


def by_hf(model_type, architectures) -> ArchSpec | None:
    """The spec of a config.json: by model_type, else by an architectures entry."""
    if model_type is not None:
        return next((s for s in SPECS.values() if s.hf_model_type == model_type), None)
    if isinstance(architectures, list):
        return next((s for s in SPECS.values() if any(a in s.hf_architectures for a in architectures)), None)
    return None
