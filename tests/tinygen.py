"""What the tiny-checkpoint generators (qwen2gen.py, gemma3gen.py, spmgen.py) share: JSON files written
byte-stably, and writing a GGUF as llama.cpp's converter does (the quant names of its --outtype, HF ->
GGUF tensor names through a map of per-layer suffixes, a tensor stored in a quant type (1-D tensors
stay F32) and the float values a reader gets back from it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_json(path: Path, obj) -> None:
    """JSON as the generators write every file: indented, UTF-8, LF line ends, a final newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8", newline="\n")


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


def gguf_name(hf_name: str, names: dict[str, str]) -> str:
    """A GGUF tensor name: `names` maps whole HF names and the suffixes after model.layers.N."""
    if hf_name in names:
        return names[hf_name]
    parts = hf_name.split(".")  # model.layers.N.rest
    return f"blk.{parts[2]}." + names[".".join(parts[3:])]


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


def tied_hf_model(model, weights: dict):
    """A transformers causal LM with tied embeddings holding `weights` (HF names -> float arrays), as
    float32 in eval mode; raises where the names do not fit or the output is not tied."""
    import torch

    model = model.to(torch.float32)
    sd = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")
    return model.eval()
