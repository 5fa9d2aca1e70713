"""Hugging Face model directories -> Checkpoint: config.json, safetensors weights (one file or
shards), and the tokenizer files (`tokenizer/hf.py`).

A directory is read as transformers would read it for its architecture (`arch/`: model_type or
architectures picks the spec) and brought to tinydet's canonical names. HF's Q/K row order
(rotate-half) *is* the canonical layout, so nothing is permuted; the output matrix is tied to the
token embedding only when `lm_head.weight` is absent and config.json says tie_word_embeddings (or,
without that key, its architecture's transformers config class ties by default: Gemma 3). A tensor that
HF stores offset from its canonical value (`arch.TensorSpec.hf_offset`: Gemma's norm weights hold w for
a scale of 1 + w) is read as float32(offset + stored), the value the kernels and a GGUF file use.

gpt-oss stores each layer's experts as one tensor (`arch.TensorSpec.hf_stacked`), in the hub's
checkpoints as MXFP4 blocks and scales (config.json quantization_config mxfp4: `hf_mxfp4.py`).

Pickle checkpoints (pytorch_model.bin, *.pt, *.pth, ..., or a pickle under any name: `pickles.py`)
are refused, never opened: unpickling runs arbitrary code.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from .. import arch as archs
from ..arch.rope_params import LAYER_TYPES, per_layer_type, rope_object
from ..config import ModelConfig, RoPE
from ..errors import ModelFormatError
from ..jsonfile import is_int as _is_int
from ..jsonfile import read_json as _read_json
from ..tokenizer.hf import CONFIG_FILE, TOKENIZER_FILE, read_hf_tokenizer
from .checkpoint import Checkpoint, Tensor
from .hf_mxfp4 import is_mxfp4, mxfp4_stack
from .pickles import PICKLE_SUFFIXES, refuse_pickle
from .safetensors import SafetensorsFile

# Buffers some older checkpoints saved alongside the weights; recomputed from the config, never read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = tuple(f"*{s}" for s in PICKLE_SUFFIXES)


# ---------------------------------------------------------------------------------------------------
# config.json


class _Fields:
    """Typed reads of config.json's keys; errors name the key."""

    def __init__(self, c: dict, path: Path, prefix: str = ""):
        self.c, self.path, self.prefix = c, path, prefix  # prefix: "rope_scaling." for a nested object
        # Whether the output is tied to the embedding when config.json has no tie_word_embeddings: an
        # architecture's hook sets it where transformers' config class defaults to tying (Gemma 3).
        self.tie_default = False

    def bad(self, key: str, msg: str):
        raise ModelFormatError(self.path, self.prefix + key, msg)

    def nested(self, key: str, obj: dict) -> _Fields:
        """A reader of the object at `key` (its errors name "key.field")."""
        return _Fields(obj, self.path, f"{self.prefix}{key}.")

    def get(self, key: str, default=None):
        v = self.c.get(key)
        return default if v is None else v

    def int(self, key: str, default=None) -> int:
        if self.c.get(key) is None:
            if default is not None:
                return default
            self.bad(key, "required field is missing")
        v = self.c[key]
        if not _is_int(v):
            self.bad(key, f"expected an integer, found {v!r}")
        if v <= 0:
            self.bad(key, f"expected a positive integer, found {v!r}")
        return v

    def float(self, key: str, default=None) -> float:
        if self.c.get(key) is None:
            if default is not None:
                return default
            self.bad(key, "required field is missing")
        v = self.c[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.bad(key, f"expected a number, found {v!r}")
        return float(v)


    def layer_types(self, n: int, default: Callable[[], list[str]]) -> list[str]:
        """layer_types: n entries of LAYER_TYPES, or `default()` where the key is absent (each
        architecture's transformers rule for configs without it)."""
        types = self.c.get("layer_types")
        if types is None:
            return default()
        # Each entry is checked to be a string before set(): a list or an object in it is unhashable.
        if (not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types)
                or not set(types) <= set(LAYER_TYPES)):
            self.bad("layer_types", f"expected {n} entries of 'sliding_attention' or 'full_attention', found {types!r}")
        return types


def _rope(f: _Fields, spec: archs.ArchSpec) -> RoPE:
    """RoPE from rope_theta (transformers 4.x, + rope_scaling) or rope_parameters (5.x). Where
    rope_parameters is keyed by layer type, this is its full_attention entry's: the other layer types'
    are the spec's hook's to read (`arch.rope_params.rope_object`), and refused when it does not."""
    theta = f.float("rope_theta", 10000.0) if f.c.get("rope_theta") is not None else None
    rope = RoPE()
    for key in ("rope_scaling", "rope_parameters"):
        rp = f.c.get(key)
        if key == "rope_parameters" and per_layer_type(rp):
            key, rp = "rope_parameters.full_attention", rp.get("full_attention")
        if rp is None:
            continue
        rope, theta = rope_object(f, key, rp, spec, theta)
    return dataclasses.replace(rope, base=10000.0 if theta is None else theta)


def _config_path(path: str | Path) -> Path:
    cpath = Path(path) / CONFIG_FILE
    if not cpath.is_file():
        raise ModelFormatError(cpath, CONFIG_FILE, "missing: not a Hugging Face model directory")
    return cpath


def read_hf_config(path: str | Path, n_tensors: int | None = None) -> tuple[archs.ArchSpec, ModelConfig, bool, dict]:
    """A directory's config.json -> (spec, ModelConfig, tie_word_embeddings, raw dict). `n_tensors`:
    how many tensors the directory's weight files hold (None: count them here), the most layers
    num_hidden_layers may say."""
    cpath = _config_path(path)
    c = _read_json(cpath, CONFIG_FILE)
    f = _Fields(c, cpath)
    model_type, hf_archs = c.get("model_type"), c.get("architectures")
    spec = archs.by_hf(model_type, hf_archs)
    classes = [a for s in archs.SPECS.values() for a in s.hf_architectures]
    if spec is None and model_type is not None:
        supported = ", ".join(repr(s.hf_model_type) for s in archs.SPECS.values())
        f.bad("model_type", f"model type {model_type!r} is not supported (supported: {supported})")
    if spec is None:
        f.bad("model_type", f"missing, and architectures is {hf_archs!r}, none of {classes}: "
                            "only Llama-family models are supported")
    if isinstance(hf_archs, list) and hf_archs and not any(a in spec.hf_architectures for a in hf_archs):
        f.bad("architectures", f"{hf_archs!r} has no {' or '.join(spec.hf_architectures)}: only causal "
                               "language models are supported")

    dim = f.int("hidden_size")
    n_heads = f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", n_heads)
    if dim % n_heads and not (spec.own_head_dim and c.get("head_dim") is not None):
        f.bad("num_attention_heads", f"{n_heads} heads do not divide hidden_size {dim}")
    head_dim = dim // n_heads
    if c.get("head_dim") is not None and c["head_dim"] != head_dim:
        if not spec.own_head_dim:
            f.bad("head_dim", f"expected hidden_size / num_attention_heads = {head_dim}, found {c['head_dim']!r} "
                              "(a head dimension of its own is not supported)")
        head_dim = f.int("head_dim")
    act = c.get("hidden_act", spec.hf_activations[0])
    if act not in spec.hf_activations:
        f.bad("hidden_act", f"activation {act!r} is not supported (supported: "
                            f"{', '.join(repr(a) for a in spec.hf_activations)})")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key) and not (key == "attention_bias" and spec.flags.get("qkv_bias")):
            f.bad(key, "biases are not supported")
    if c.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        f.bad("partial_rotary_factor", f"partial RoPE is not supported, found {c['partial_rotary_factor']!r}")
    rope = _rope(f, spec)
    n_layers = f.int("num_hidden_layers")
    # Every layer has tensors of its own: a larger count is refused before the hooks below make
    # per-layer tables of that length (2**32 layers ran for minutes).
    if n_tensors is None:
        n_tensors = sum(len(w.tensors) for w in _find_weight_files(cpath.parent)[0])
    if n_layers > n_tensors:
        f.bad("num_hidden_layers", f"expected 1..{n_tensors} layers (the weight files have {n_tensors} tensors), "
                                   f"found {n_layers}")
    fields = dict(arch=spec.name, n_layers=n_layers, dim=dim, ffn_dim=f.int("intermediate_size"),
                  n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=f.int("vocab_size"),
                  context_length=f.int("max_position_embeddings"), rope=rope, rms_eps=f.float("rms_norm_eps"),
                  **spec.flags)
    if spec.hf_config is not None:
        fields = spec.hf_config(f, fields)
    rp = c.get("rope_parameters")
    if per_layer_type(rp) and set(rp) - {"full_attention"} and not fields.get("layer_ropes"):
        f.bad("rope_parameters", f"RoPE parameters per layer type ({', '.join(sorted(rp))}) are not supported "
                                 f"for {spec.hf_architectures[0]}")
    tie = c.get("tie_word_embeddings", f.tie_default)
    if not isinstance(tie, bool):
        f.bad("tie_word_embeddings", f"expected true or false, found {tie!r}")
    cfg = ModelConfig(**fields).validate(cpath, {
        "n_layers": "num_hidden_layers", "dim": "hidden_size", "ffn_dim": "intermediate_size",
        "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
        "head_dim": "head_dim" if c.get("head_dim") is not None else "num_attention_heads",
        "vocab_size": "vocab_size", "context_length": "max_position_embeddings", "rope_base": "rope_theta",
        "rms_eps": "rms_norm_eps",
    })
    return spec, cfg, tie, c


# ---------------------------------------------------------------------------------------------------
# Weight files


def _find_weight_files(path: Path) -> tuple[list[SafetensorsFile], Path]:
    """The directory's safetensors files (validated headers) and the file that lists them."""
    single, index = path / SAFETENSORS_FILE, path / INDEX_FILE
    if single.is_file():
        refuse_pickle(single, SAFETENSORS_FILE)  # a pickle under a safetensors name is still a pickle
        return [SafetensorsFile(single)], single
    if index.is_file():
        idx = _read_json(index, INDEX_FILE)
        wm = idx.get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ModelFormatError(index, "weight_map", "expected a non-empty object of tensor name -> shard file")
        files: dict[str, SafetensorsFile] = {}
        for name, shard in wm.items():
            if shard in files:
                continue
            if Path(shard).name != shard or shard in (".", ".."):
                raise ModelFormatError(index, f"weight_map.{name}",
                                       f"shard {shard!r} is not a plain file name in the model directory")
            if not (path / shard).is_file():
                raise ModelFormatError(index, f"weight_map.{name}", f"shard {shard!r} is missing from {path}")
            refuse_pickle(path / shard, f"weight_map.{name}")
            files[shard] = SafetensorsFile(path / shard)
        for name, shard in wm.items():
            if name not in files[shard].tensors:
                raise ModelFormatError(index, f"weight_map.{name}", f"shard {shard!r} has no tensor {name!r}")
        return list(files.values()), index
    pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in path.glob(pat) if p.is_file()})
    if pickles:
        raise ModelFormatError(
            path / pickles[0], "weights",
            f"only pickle checkpoints found ({', '.join(pickles)}): tinydet does not load them, because "
            "unpickling can run arbitrary code; convert the model to safetensors (model.safetensors) first")
    raise ModelFormatError(path / SAFETENSORS_FILE, "weights",
                           f"missing: neither {SAFETENSORS_FILE} nor {INDEX_FILE} is in {path}")


def _tensors(files: list[SafetensorsFile], spec: archs.ArchSpec, cfg: ModelConfig, tie: bool, listing: Path,
             progress: Callable[[int, int, str], None] | None, mxfp4: bool = False) -> dict[str, Tensor]:
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.tensors:
            if name in where:
                raise ModelFormatError(f.path, name, f"tensor also stored in {where[name].path.name}")
            where[name] = f
    known = {t.hf.format(*idx) for _, t, idx in spec.tensors_for(cfg)}
    if mxfp4:  # the hub's gpt-oss: stacked expert matrices as MXFP4 blocks and scales
        known |= {t.hf.format(*idx) + part for _, t, idx in spec.tensors_for(cfg) if t.hf_stacked
                  for part in ("_blocks", "_scales")}
    for name, f in where.items():
        if name not in known and not name.endswith(_IGNORED_SUFFIXES):
            raise ModelFormatError(f.path, name, f"unexpected tensor: not part of a {spec.hf_architectures[0]} "
                                                 "with this config.json (biases, extra layers and other "
                                                 "architectures are not supported)")

    def find(canon, hname, want, t):
        f = where.get(hname)
        if f is None and mxfp4 and t.hf_stacked and hname + "_blocks" in where:
            f = where[hname + "_blocks"]
            if where.get(hname + "_scales") is not f:
                raise ModelFormatError(f.path, hname + "_scales", f"expected beside {hname}_blocks in {f.path.name}")
            return mxfp4_stack(f, hname, want, t.hf_transposed)
        if f is None:
            if canon == archs.TIED[0]:
                if tie:
                    return None  # tied
                raise ModelFormatError(listing, hname, "required tensor is missing (and config.json's "
                                                       "tie_word_embeddings is false)")
            raise ModelFormatError(listing, hname, "required tensor is missing")
        st = f.tensors[hname]
        if st.shape != want:
            raise ModelFormatError(f.path, hname, f"expected shape {want} from config.json, found {st.shape}")
        # Stored offset (Gemma's norms hold w for a scale of 1 + w): the kernels get float32(offset + w).
        return f.tensor(hname).plus(t.hf_offset) if t.hf_offset else f.tensor(hname)

    return spec.gather(cfg, "hf", find, progress)


# ---------------------------------------------------------------------------------------------------


def open_hf_dir(path: str | Path, progress: Callable[[int, int, str], None] | None = None) -> Checkpoint:
    """A Hugging Face directory -> Checkpoint. `progress(done, total, name)` is called as each tensor
    is found and checked, and once at the end."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(path, "path", "not a directory")
    _config_path(path)  # a directory without config.json is not a model directory, whatever its weights
    files, listing = _find_weight_files(path)
    spec, cfg, tie, raw = read_hf_config(path, sum(len(f.tensors) for f in files))
    tokenizer = read_hf_tokenizer(path, raw)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelFormatError(path / TOKENIZER_FILE, TOKENIZER_FILE,
                               f"{tokenizer.vocab_size} tokens but config.json's vocab_size is {cfg.vocab_size}")
    tensors = _tensors(files, spec, cfg, tie, listing, progress, is_mxfp4(raw))
    metadata = {
        "format": "huggingface",
        "config": raw,
        "files": [f.path.name for f in files],
        "safetensors_metadata": files[0].metadata if len(files) == 1 else {f.path.name: f.metadata for f in files},
    }
    stored = [(name, st.dtype, st.shape) for f in files for name, st in f.tensors.items()]
    return Checkpoint(cfg, tensors, tokenizer, metadata, path, spec, "huggingface", stored)
