"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer files).

The weights come through tinydet's own GGUF path (dequantized exactly, Q/K rows un-permuted), so they
are already in HF's layout under canonical names; the architecture's spec (`arch/`) gives their HF
names and its class. The result loads in transformers as that class (LlamaForCausalLM, ...) and in
tinydet with the same logits, bit for bit, as the GGUF. Canonical tensors that HF stores as the rows
of one (`arch.TensorSpec.fused`: Phi-3's qkv_proj and gate_up_proj) are written as that one tensor,
their rows concatenated in order. A Mistral GGUF is a `llama` one (llama.cpp's converter writes it so)
and becomes a LlamaForCausalLM directory.

`dtype="fp16"` stores the matrices (embedding, projections, output) as binary16, rounded once with
NumPy's round-to-nearest-even, and keeps the RMSNorm weights float32 — exactly what tinydet's fp16
mode stores, so that directory at fp16 runs the same bits as the GGUF at fp16.

A tensor that HF stores offset from its value (`arch.TensorSpec.hf_offset`: Gemma's norm weights, w
for a scale of 1 + w, which GGUF stores as 1 + w) is written as float32(value - offset), and reading the
directory computes float32(offset + that). For an offset of 1 that gives back every stored value s in
[0.5, 2**24] exactly (for s in [0.5, 2], s - 1 is exact by Sterbenz's lemma; above, s and 1 are
multiples of ulp(s) <= 1, so s - 1 is exact, and 1 + (s - 1) = s), so the directory runs the GGUF's
bits; a value below 0.5 may come back changed (s - 1 rounds: s = 2**-30 becomes w = -1, then 0).

Files are written into a temporary sibling directory that is renamed into place at the end: a failed
or interrupted conversion (a full disk included, reported as one TinydetError line) leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from .. import arch as archs
from ..errors import TinydetError
from ..formats.gguf_model import open_gguf
from ..formats.hf_dir import SAFETENSORS_FILE
from ..tokenizer.hf import CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

__all__ = ["convert_gguf_to_hf", "CONVERT_DTYPES"]

CONVERT_DTYPES = ("fp32", "fp16")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)


# What a conversion writes: the only entries a directory may hold for `overwrite` to replace it.
OUTPUT_FILES = frozenset({SAFETENSORS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE,
                          CONFIG_FILE})


def _check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output directory whose replacement could lose anything: the working directory or
    one holding it, a non-empty one without `overwrite`, and, even with it, one that holds anything
    but a conversion's own files (say a checkout and its .git, or the GGUF being converted)."""
    real, cwd = out.resolve(), Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise TinydetError(f"{out}: is the current directory or contains it; name a new directory for the output")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise TinydetError(f"{out}: exists and is not a directory")
        entries = sorted(p.name for p in out.iterdir())
        if entries and not overwrite:
            raise TinydetError(f"{out}: directory exists and is not empty (overwrite=True, or "
                               "`tinydet convert --overwrite`, replaces a directory a conversion wrote)")
        other = [e for e in entries if e not in OUTPUT_FILES or not (out / e).is_file()]
        if other:
            listed = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
            raise TinydetError(f"{out}: holds {listed}, which a conversion does not write; overwrite replaces "
                               "only a directory a conversion wrote (remove them, or name another directory)")


def _stack_experts(parts: dict, n_experts: int, transposed: bool) -> np.ndarray:
    """An expert stack (`arch.TensorSpec.hf_stacked`) from its parts {(expert, interleave): array}: each
    expert's array, or its two interleaved ones (rows of the canonical matrix: columns once
    transposed, elements of a vector) woven back together."""
    out = []
    for e in range(n_experts):
        if (e, None) in parts:
            out.append(parts[(e, None)])
            continue
        a, b = parts[(e, 0)], parts[(e, 1)]
        axis = -1 if transposed or a.ndim == 1 else 0
        both = np.empty(a.shape[:axis % a.ndim] + (2 * a.shape[axis],) + a.shape[axis % a.ndim + 1:], a.dtype)
        sl = [slice(None)] * a.ndim
        sl[axis] = slice(0, None, 2)
        both[tuple(sl)] = a
        sl[axis] = slice(1, None, 2)
        both[tuple(sl)] = b
        out.append(both)
    return np.ascontiguousarray(np.stack(out))  # C order: the writer saves the raw buffer


def _hf_rope_scaling(rope, src: Path) -> dict | None:
    """config.json's rope_scaling (transformers 4.x form) for a RoPE read from a GGUF."""
    if rope.scaling == "none":
        return None
    if rope.scaling == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    if rope.scaling == "llama3":
        return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor, "original_max_position_embeddings": rope.original_context}
    if rope.scaling == "yarn":
        return {"rope_type": "yarn", "factor": rope.factor, "original_max_position_embeddings": rope.original_context,
                "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "truncate": rope.truncate,
                "attention_factor": rope.attention_factor}
    raise TinydetError(f"{src}: rope_freqs.weight: these per-frequency RoPE factors match no Llama 3 RoPE scaling "
                       "exactly, so config.json cannot say them (the GGUF itself runs as it is)")


def convert_gguf_to_hf(gguf_path, out_dir, dtype: str = "fp32", overwrite: bool = False,
                       progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Convert a GGUF model to a Hugging Face directory at `out_dir`; returns its path.

    `dtype` is "fp32" or "fp16" (matrices as binary16, norms float32). A non-empty `out_dir` is
    refused unless `overwrite`, which replaces only a directory holding nothing but a conversion's
    files; the working directory, or one holding it or the source, never. `progress(done, total,
    name)` reports the tensors as they are read."""
    if dtype not in CONVERT_DTYPES:
        raise TinydetError(f"dtype: expected one of {', '.join(CONVERT_DTYPES)}, found {dtype!r}")
    src = Path(gguf_path)
    if not str(out_dir).strip():
        raise TinydetError("output directory: empty path (name a directory for the Hugging Face files)")
    out = Path(os.path.abspath(out_dir))  # "x/.." needs a real name for the sibling temp directory
    if out.resolve() in src.resolve().parents:
        raise TinydetError(f"{out}: holds the source {src}; name another directory for the output")
    _check_out_dir(out, overwrite)

    ck = open_gguf(src, progress)  # canonical names, HF's Q/K layout
    cfg, tok, spec, weights = ck.config, ck.tokenizer, ck.arch, ck.tensors
    if not cfg.dense_ffn and spec.hf_moe_spec:  # Mixtral, read from a `llama` file
        spec = archs.SPECS[spec.hf_moe_spec]
    tied = weights[archs.TIED[0]] is weights[archs.TIED[1]]
    rope_scaling = _hf_rope_scaling(cfg.rope, src)  # before any work: a RoPE config.json cannot say is refused

    tensors: dict[str, np.ndarray] = {}  # HF name -> array; shapes as in the spec
    fused: dict[str, list] = {}  # HF name of a fused tensor -> its parts so far, by part index
    stacked: dict[str, dict] = {}  # HF name of an expert stack -> its parts so far, by (expert, interleave)
    for canon, t, idx in spec.tensors_for(cfg):
        if canon == archs.TIED[0] and tied:
            continue
        w = weights[canon].float32()
        if t.hf_offset:  # HF stores value - offset (Gemma's norms: w for a scale of 1 + w); see below
            w = w - np.float32(t.hf_offset)
        if dtype == "fp16" and w.ndim == 2:
            w = w.astype(np.float16)  # the one rounding: IEEE round-to-nearest-even
        name = t.hf.format(*idx)
        if t.experts and t.hf_stacked:  # every expert of a layer in one tensor (gpt-oss), [in, out] where transposed
            w = w.T if t.hf_transposed else w
            parts = stacked.setdefault(name, {})
            parts[(idx[1], t.hf_interleave)] = w
            n_parts = cfg.n_experts * (1 if t.hf_interleave is None else 2)
            if len(parts) == n_parts:
                tensors[name] = _stack_experts(stacked.pop(name), cfg.n_experts, t.hf_transposed)
            continue
        if t.fused:  # one stored tensor, its parts' rows in order (Phi-3's qkv_proj, gate_up_proj)
            parts = fused.setdefault(name, [None] * len(t.fused))
            parts[t.part] = w
            if all(p is not None for p in parts):
                tensors[name] = np.concatenate(fused.pop(name))
        else:
            tensors[name] = w

    def piece(i):
        return None if i is None else tok.hf.id_to_token(i)

    eos = list(tok.eos_ids)
    config = {
        "architectures": [spec.hf_architectures[0]],
        "model_type": spec.hf_model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "rope_theta": cfg.rope_base,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": cfg.rms_eps,  # the file's float32 value, widened exactly
        **(spec.hf_config_out(cfg) if spec.hf_config_out else {}),
        "tie_word_embeddings": tied,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": "float16" if dtype == "fp16" else "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": piece(tok.bos_id),
        "eos_token": piece(tok.eos_id),
        "unk_token": piece(tok.unk_id),
        "pad_token": piece(tok.pad_id),
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.context_length,
    }
    if tok.chat_template is not None:
        tokenizer_config["chat_template"] = tok.chat_template
    generation_config = {
        "bos_token_id": tok.bos_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if tok.pad_id is not None:
        generation_config["pad_token_id"] = tok.pad_id
    st_meta = {"format": "pt", "converted_from": src.name, "converter": "tinydet"}
    name = ck.metadata.get("general.name")
    if isinstance(name, str):
        st_meta["general.name"] = name

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_safetensors(tmp / SAFETENSORS_FILE, tensors, st_meta)
        del tensors, weights
        (tmp / TOKENIZER_FILE).write_text(tok.hf.to_str(), encoding="utf-8")
        _write_json(tmp / TOKENIZER_CONFIG_FILE, tokenizer_config)
        _write_json(tmp / GENERATION_CONFIG_FILE, generation_config)
        _write_json(tmp / CONFIG_FILE, config)
        # mkdtemp makes the directory 0700 (and safetensors its file 0600): give them the usual modes.
        mask = _umask()
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        _move_into_place(tmp, out, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = _write_failure(e)
        if why is not None:  # a full disk, a read-only or vanished folder: one line, not a traceback
            raise TinydetError(f"{out}: write: {why}; nothing was left behind") from None
        raise
    return out


def _write_failure(e: BaseException) -> str | None:
    """The OS's reason when `e` is a failure to write (safetensors reports its I/O errors as a
    SafetensorError, "Error while serializing: I/O error: <reason> (os error N)"), else None."""
    from safetensors import SafetensorError

    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, SafetensorError) and "I/O error" in str(e):
        return str(e).split("I/O error: ", 1)[-1]
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename `tmp` to `out`. An existing empty `out` is replaced; a non-empty one only with
    `overwrite`, moved aside first and deleted once the new directory is in place."""
    _check_out_dir(out, overwrite)  # again: it may have changed during the conversion
    if not out.exists():
        os.rename(tmp, out)
        return
    if not any(out.iterdir()):
        os.rmdir(out)
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
