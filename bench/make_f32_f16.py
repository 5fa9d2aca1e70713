"""Make F32 and F16 GGUF files from a quantized GGUF, for benchmarking against peers that are fastest
on (or only support) float weights.

    python bench/make_f32_f16.py SRC.gguf [--out-dir .] [--types f32,f16]

Every tensor is dequantized with `gguf.quants.dequantize` (exact: the quantized values are what the
model is) and written with the same name, the same shape and llama.cpp's layout (no Q/K permutation
changes); the metadata is copied key by key, except `general.file_type` (0 = all F32, 1 = mostly F16).
The F32 file holds every tensor as F32; the F16 file stores matrices (2-D tensors) as F16, rounded
once to nearest even, and keeps 1-D tensors (the norms) F32, as llama.cpp's converter does.
Output names: SRC's stem with its quant suffix replaced, e.g. SmolLM2-135M-Instruct.F32.gguf.
Needs the `gguf` package (pip install gguf).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

FILE_TYPE = {"f32": 0, "f16": 1}  # llama_ftype: ALL_F32, MOSTLY_F16


def out_name(src: Path, kind: str) -> str:
    stem = src.stem
    m = re.match(r"(.*)[.-](Q\d\w*|IQ\w+|F16|F32|BF16)$", stem, re.IGNORECASE)
    base = m.group(1) if m else stem
    return f"{base}.{kind.upper()}.gguf"


def field_value(field):
    """(value, type, sub_type) of a reader field, ready for GGUFWriter.add_key_value."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not supported")
        return field.contents(), vtype, sub
    return field.contents(), vtype, None


def convert(src: Path, dst: Path, kind: str) -> None:
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_key_value(name, FILE_TYPE[kind], GGUFValueType.UINT32)
            continue
        value, vtype, sub = field_value(field)
        w.add_key_value(name, value, vtype, sub)
    if "general.alignment" in r.fields:
        w.data_alignment = int(r.fields["general.alignment"].contents())
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy order: (rows, cols) = GGUF dims reversed
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            assert x.dtype == np.float32
        x = np.ascontiguousarray(x, dtype=np.float32)
        expect = tuple(int(d) for d in reversed(t.shape.tolist()))
        if x.shape != expect:
            x = x.reshape(expect)
        if kind == "f16" and x.ndim >= 2:
            x = x.astype(np.float16)  # IEEE round to nearest even
        w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("."),
                    help="folder for the new files (default: the current one)")
    ap.add_argument("--types", default="f32,f16", help="comma-separated: f32, f16")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for kind in [k.strip().lower() for k in a.types.split(",") if k.strip()]:
        if kind not in FILE_TYPE:
            ap.error(f"--types: unknown type {kind!r} (f32, f16)")
        dst = a.out_dir / out_name(a.src, kind)
        tmp = dst.with_suffix(".part")
        convert(a.src, tmp, kind)
        tmp.replace(dst)
        print(f"{dst}  {dst.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
