"""Random-weight GGUF files of real architectures' shapes, for benchmarks at the sizes people run.

    python bench/make_random_gguf.py --shape llama-1b --type Q4_0[,Q8_0,...] [--seed 0] [--pure]
        [--out-dir .] [--tokenizer smollm2-135m-instruct]

Shapes (`--shape`):
  llama-1b  Llama-3.2-1B's body: dim 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64, FFN 8192,
            RoPE theta 500000 with Llama 3's rope_freqs (factor 32), tied embeddings (no output.weight)
  llama-8b  Llama-3.1-8B's: dim 4096, 32 layers, 32 / 8 heads, head_dim 128, FFN 14336, rope_freqs
            (factor 8), an untied output.weight
  tiny      2 layers, dim 256, 4 / 2 heads, FFN 512, untied: for the tests (seconds)
  qwen3moe-30b-a3b
            Qwen3-30B-A3B's body (a `qwen3moe` file): dim 2048, 48 layers, 32 heads / 4 KV heads,
            head_dim 128 with QK-norm, and in every layer 128 experts of width 768 of which a token
            takes 8 (the router ffn_gate_inp F32, as llama.cpp's converter keeps it), RoPE theta 1e6,
            untied. `--layers N` writes its first N layers only (a file of the same layers, for
            measuring per-layer speed where 48 would not fit a machine's memory or time)
  qwen3moe-tiny  2 layers, dim 256, 8 experts of width 128, 2 per token: for the tests
  gpt-oss-20b
            gpt-oss-20b's body (a `gpt-oss` file, --type MXFP4): dim 2880, 24 layers, 64 heads / 8 KV
            heads of 64, q/k/v/o biases, attention sinks, every other layer a 128-token window, YaRN
            (factor 32, original 4096), and in every layer 32 experts of width 2880 of which a token
            takes 4, with biases; the experts MXFP4 as in the released files, other matrices Q8_0,
            the router and every vector F32. `--layers N` as above
  gpt-oss-tiny   2 layers, dim 256, 8 experts of width 256, 2 per token: for the tests
All take SmolLM2's tokenizer (every `tokenizer.ggml.*` key and the chat template, copied from
--tokenizer: a GGUF file, or a known model's name, pulled as `tinydet pull` does; default
smollm2-135m-instruct), so the vocabulary is its 49,152 tokens, not Llama 3's 128,256.

Types (`--type`, several comma-separated: the same weights in each): F16 (matrices F16), Q8_0, Q4_0,
Q4_K_M, and MXFP4 for gpt-oss (its experts' blocks are random codes under exponents 2^-9..2^-6, not
quantized values: MXFP4 has no quantizer here, and a benchmark needs only their size and finiteness). The types of the matrices follow llama.cpp's llama-quantize (src/llama-quant.cpp,
`llama_tensor_get_type`): the output matrix is Q6_K in Q4_0 and Q4_K_M files (Q8_0 stays Q8_0), and so
is token_embd when the embeddings are tied (it is then the output matrix); in Q4_K_M, attn_v and ffn_down
are Q6_K in the layers `use_more_bits` picks (the first and last eighth, and every third between), the
other matrices Q4_K. `--pure` stores every matrix in the base type instead (llama-quantize --pure).
Norms and rope_freqs are F32.

Weights: N(0, 0.02) in float32 from NumPy's PCG64, seeded per tensor by (--seed, the tensor's name),
so a tensor's values do not depend on the type or on the other tensors; norms are 1.0. The bytes of a
file depend on the shape, type and seed alone. Q8_0/Q4_0 are quantized by the `gguf` package, Q4_K/Q6_K
by bench/quantize.py (a plain min/max rule, NumPy, see there). Each tensor is written in slices of
rows, so memory stays near 200 MB whatever the size; the file appears under its name only when complete
(written as NAME.part, then renamed). Names and metadata keys are those llama.cpp's converter writes
(`llama.*`; Q/K rows are not permuted: with random weights it makes no difference).
Output: OUT_DIR/{shape}-random.{type}.gguf (with --pure: {shape}-random-pure.{type}.gguf), e.g.
llama-1b-random.Q4_K_M.gguf.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize import quantize

TOKENIZER_MODEL = "smollm2-135m-instruct"  # a known model (models/*.toml): its file gives the tokenizer
STD = 0.02
CHUNK = 1 << 22  # values generated and quantized at a time: bounds memory, a multiple of every block size


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_factor: float | None  # Llama 3's rope_scaling factor (low 1, high 4, original context 8192)
    context: int = 131072
    rope_theta: float = 500000.0
    eps: float = 1e-5
    arch: str = "llama"
    experts: int = 0  # a mixture of experts in every layer (qwen3moe): its experts, ffn their width
    experts_used: int = 0


SHAPES = {
    "llama-1b": Shape(dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, tied=True, rope_factor=32.0),
    "llama-8b": Shape(dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, tied=False,
                      rope_factor=8.0),
    "tiny": Shape(dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=False, rope_factor=8.0,
                  context=8192),
    "qwen3moe-tiny": Shape(dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=128, tied=False, rope_factor=None,
                           context=8192, rope_theta=1e6, eps=1e-6, arch="qwen3moe", experts=8, experts_used=2),
    "gpt-oss-tiny": Shape(dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=256, tied=False,
                          rope_factor=None, context=8192, rope_theta=150000.0, arch="gpt-oss", experts=8,
                          experts_used=2),
    "gpt-oss-20b": Shape(dim=2880, layers=24, heads=64, kv_heads=8, head_dim=64, ffn=2880, tied=False,
                         rope_factor=None, rope_theta=150000.0, arch="gpt-oss", experts=32, experts_used=4),
    "qwen3moe-30b-a3b": Shape(dim=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=768, tied=False,
                              rope_factor=None, context=40960, rope_theta=1e6, eps=1e-6, arch="qwen3moe",
                              experts=128, experts_used=8),
}
MOE_DENSE_FFN = 6144  # Qwen3-30B-A3B's feed_forward_length (its dense width: no layer uses it)
# llama_ftype of general.file_type, and the type of most matrices
FILE_TYPES = {"F16": (1, "F16"), "Q8_0": (7, "Q8_0"), "Q4_0": (2, "Q4_0"), "Q4_K_M": (15, "Q4_K"),
              "MXFP4": (38, "Q8_0")}  # MOSTLY_MXFP4_MOE: MXFP4 experts, Q8_0 other matrices
GPT_OSS_WINDOW, YARN_FACTOR, YARN_ORIGINAL = 128, 32.0, 4096


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits (C's `/` and `%` on
    non-negative operands, as Python's `//` and `%` for these)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def matrix_type(name: str, layer: int | None, shape: Shape, ftype: str, pure: bool) -> str:
    """The storage type llama-quantize gives matrix `name` (GGUF name) of a `ftype` file."""
    base = FILE_TYPES[ftype][1]
    if base == "F16" or pure:
        return base
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return base if base == "Q8_0" else "Q6_K"  # every dim here is a multiple of 256
    if ftype == "MXFP4" and "_exps.weight" in name:
        return "MXFP4"
    if ftype == "Q4_K_M" and name.endswith((".attn_v.weight", ".ffn_down.weight", ".ffn_down_exps.weight")) \
            and use_more_bits(layer, shape.layers):
        return "Q6_K"
    return base


def tensors(shape: Shape, vocab: int, ftype: str, pure: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, NumPy-order shape, storage type) of every tensor, in the order written."""
    d, kv = shape.dim, shape.kv_heads * shape.head_dim
    out = []
    if shape.rope_factor is not None:
        out.append(("rope_freqs.weight", (shape.head_dim // 2,), "F32"))
    out.append(("token_embd.weight", (vocab, d), matrix_type("token_embd.weight", None, shape, ftype, pure)))
    E = shape.experts
    if shape.arch == "gpt-oss":
        return out + _gpt_oss_tensors(shape, vocab, ftype, pure)
    if E:
        ffn = (("attn_q_norm", (shape.head_dim,)), ("attn_k_norm", (shape.head_dim,)), ("ffn_norm", (d,)),
               ("ffn_gate_inp", (E, d)), ("ffn_gate_exps", (E, shape.ffn, d)), ("ffn_up_exps", (E, shape.ffn, d)),
               ("ffn_down_exps", (E, d, shape.ffn)))
    else:
        ffn = (("ffn_norm", (d,)), ("ffn_gate", (shape.ffn, d)), ("ffn_up", (shape.ffn, d)),
               ("ffn_down", (d, shape.ffn)))
    for i in range(shape.layers):
        for part, rows_cols in (("attn_norm", (d,)), ("attn_q", (shape.heads * shape.head_dim, d)),
                                ("attn_k", (kv, d)), ("attn_v", (kv, d)),
                                ("attn_output", (d, shape.heads * shape.head_dim))) + ffn:
            name = f"blk.{i}.{part}.weight"
            f32 = len(rows_cols) == 1 or part == "ffn_gate_inp"  # the router stays F32 (llama.cpp's rule)
            out.append((name, rows_cols, "F32" if f32 else matrix_type(name, i, shape, ftype, pure)))
    out.append(("output_norm.weight", (d,), "F32"))
    if not shape.tied:
        out.append(("output.weight", (vocab, d), matrix_type("output.weight", None, shape, ftype, pure)))
    return out


def _gpt_oss_tensors(shape: Shape, vocab: int, ftype: str, pure: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's tensors after token_embd, as llama.cpp's converter names them."""
    d, kv, q, E, F = shape.dim, shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim, shape.experts, shape.ffn
    out = []
    for i in range(shape.layers):
        b = f"blk.{i}."
        for part, rows_cols, bias in (("attn_norm", (d,), None), ("attn_q", (q, d), (q,)), ("attn_k", (kv, d), (kv,)),
                                      ("attn_v", (kv, d), (kv,)), ("attn_output", (d, q), (d,)),
                                      ("attn_sinks", (shape.heads,), None), ("post_attention_norm", (d,), None),
                                      ("ffn_gate_inp", (E, d), (E,)), ("ffn_gate_exps", (E, F, d), (E, F)),
                                      ("ffn_up_exps", (E, F, d), (E, F)), ("ffn_down_exps", (E, d, F), (E, d))):
            name = b + part + ".weight"
            f32 = len(rows_cols) == 1 or part == "ffn_gate_inp"
            out.append((name, rows_cols, "F32" if f32 else matrix_type(name, i, shape, ftype, pure)))
            if bias is not None:
                out.append((b + part + ".bias", bias, "F32"))
    out.append(("output_norm.weight", (d,), "F32"))
    out.append(("output.weight", (vocab, d), matrix_type("output.weight", None, shape, ftype, pure)))
    return out


def rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3's rope_freqs.weight as llama.cpp's converter computes it (LlamaModel, rope_type llama3):
    per frequency pair, 1 (short wavelengths), the factor (long ones) or a smooth blend between."""
    factor, low, high, old = shape.rope_factor, 1.0, 4.0, 8192
    out = []
    for i in range(0, shape.head_dim, 2):
        freq = 1.0 / shape.rope_theta ** (np.float32(i) / np.float32(shape.head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def stored_bytes(rows_cols: tuple[int, ...], type_name: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return math.prod(rows_cols) // block * size


def tensor_slices(name: str, rows_cols: tuple[int, ...], type_name: str, seed: int):
    """The stored values of a norm or matrix, slice by slice of rows (arrays to write in order)."""
    if len(rows_cols) == 1:  # a norm
        yield np.ones(rows_cols, np.float32)
        return
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    rows, cols = math.prod(rows_cols[:-1]), rows_cols[-1]  # an expert stack's rows: every expert's, in order
    step = max(1, CHUNK // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if type_name == "MXFP4":  # random blocks (module docstring): exponent byte, 16 bytes of codes
            blocks = rng.integers(0, 256, (n, cols // 32, 17), dtype=np.uint8)
            blocks[:, :, 0] = rng.integers(118, 122, (n, cols // 32), dtype=np.uint8)
            yield blocks.reshape(n, -1)
            continue
        x = rng.standard_normal((n, cols), dtype=np.float32)
        x *= np.float32(STD)
        yield quantize(x, type_name)


def tokenizer_file(ap: argparse.ArgumentParser, name: str) -> Path:
    """--tokenizer's file: a path as given, else a known model's verified file (pulled if not cached)."""
    if Path(name).is_file():
        return Path(name)
    from tinydet.errors import TinydetError
    from tinydet.registry import resolve_model
    try:
        return resolve_model(name)
    except TinydetError as e:
        ap.error(f"--tokenizer: {e}")


def tokenizer_fields(path: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """Every tokenizer.ggml.* key and the chat template of a GGUF file, ready for add_key_value."""
    try:
        r = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise SystemExit(f"{path}: not a GGUF file to take a tokenizer from ({e})") from None
    out = []
    for name, f in r.fields.items():
        if not (name.startswith("tokenizer.ggml.") or name == "tokenizer.chat_template"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        out.append((name, f.contents(), vtype, sub))
    if not any(n == "tokenizer.ggml.tokens" for n, *_ in out):
        raise SystemExit(f"{path}: no tokenizer.ggml.tokens: not a file to take a tokenizer from")
    return out


def _log(*x) -> None:
    print(*x, flush=True)


def write(path: Path, shape_name: str, ftype: str, seed: int, pure: bool, tok_fields, log=_log,
          layers: int | None = None) -> None:
    """Write the file at `path` (through path.part, renamed when complete)."""
    shape = SHAPES[shape_name] if layers is None else dataclasses.replace(SHAPES[shape_name], layers=layers)
    vocab = len(next(v for n, v, *_ in tok_fields if n == "tokenizer.ggml.tokens"))
    plan = tensors(shape, vocab, ftype, pure)
    a = shape.arch
    w = GGUFWriter(None, a)
    w.add_type("model")
    w.add_name(f"random {shape_name} {ftype}" + (" pure" if pure else "") + f" seed {seed}")
    u32 = GGUFValueType.UINT32
    moe = (("expert_count", shape.experts), ("expert_used_count", shape.experts_used),
           ("expert_feed_forward_length", shape.ffn)) if shape.experts else ()
    for key, value in (("block_count", shape.layers), ("context_length", shape.context),
                       ("embedding_length", shape.dim),
                       ("feed_forward_length", MOE_DENSE_FFN if a == "qwen3moe" else shape.ffn),
                       ("attention.head_count", shape.heads), ("attention.head_count_kv", shape.kv_heads)) + moe:
        w.add_key_value(f"{a}.{key}", value, u32)
    w.add_key_value(f"{a}.rope.freq_base", shape.rope_theta, GGUFValueType.FLOAT32)
    if a == "gpt-oss":
        w.add_key_value(f"{a}.attention.sliding_window", GPT_OSS_WINDOW, u32)
        w.add_key_value(f"{a}.rope.scaling.type", "yarn", GGUFValueType.STRING)
        w.add_key_value(f"{a}.rope.scaling.factor", YARN_FACTOR, GGUFValueType.FLOAT32)
        w.add_key_value(f"{a}.rope.scaling.original_context_length", YARN_ORIGINAL, u32)
    w.add_key_value(f"{a}.attention.layer_norm_rms_epsilon", shape.eps, GGUFValueType.FLOAT32)
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        w.add_key_value(f"{a}.{key}", shape.head_dim, u32)
    w.add_key_value("general.file_type", FILE_TYPES[ftype][0], u32)
    w.add_key_value(f"{a}.vocab_size", vocab, u32)
    for name, value, vtype, sub in tok_fields:
        w.add_key_value(name, value, vtype, sub)
    if ftype != "F16":
        w.add_key_value("general.quantization_version", 2, u32)
    for name, rows_cols, t in plan:
        w.add_tensor_info(name, rows_cols, np.dtype(np.float32), stored_bytes(rows_cols, t), GGMLQuantizationType[t])
    tmp = path.with_name(path.name + ".part")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    align = w.data_alignment
    total = sum(stored_bytes(rc, t) for _, rc, t in plan)
    done, t0, last = 0, time.perf_counter(), 0.0
    with open(tmp, "ab") as f:
        for name, rows_cols, t in plan:
            f.write(b"\0" * (-f.tell() % align))
            start = f.tell()
            parts = [rope_factors(shape)] if name == "rope_freqs.weight" else tensor_slices(name, rows_cols, t, seed)
            for a in parts:
                a.tofile(f)
            if f.tell() - start != stored_bytes(rows_cols, t):
                raise AssertionError(f"{name}: wrote {f.tell() - start} bytes, expected {stored_bytes(rows_cols, t)}")
            done += stored_bytes(rows_cols, t)
            now = time.perf_counter() - t0
            if now - last > 5 or done == total:
                log(f"  {path.name}: {done / 2**30:.2f} of {total / 2**30:.2f} GiB, {now:.0f} s")
                last = now
        f.write(b"\0" * (-f.tell() % align))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--type", required=True, help=f"comma-separated: {', '.join(FILE_TYPES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pure", action="store_true", help="every matrix in the base type (no Q6_K output, no mix)")
    ap.add_argument("--layers", type=int, help="write only the shape's first N layers (file name: ...-{N}l)")
    ap.add_argument("--out-dir", type=Path, default=Path("."), help="folder for the files (default: the current one)")
    ap.add_argument("--tokenizer", default=TOKENIZER_MODEL,
                    help=f"GGUF file or known model to copy the tokenizer from "
                         f"(default {TOKENIZER_MODEL}, pulled on first use)")
    a = ap.parse_args()
    types = [t.strip().upper() for t in a.type.split(",") if t.strip()]
    for t in types:
        if t not in FILE_TYPES:
            ap.error(f"--type: unknown type {t!r} (one of {', '.join(FILE_TYPES)})")
    if a.layers is not None and not 0 < a.layers <= SHAPES[a.shape].layers:
        ap.error(f"--layers: expected 1..{SHAPES[a.shape].layers}")
    if not 0 <= a.seed < 2**63:
        ap.error("--seed: expected a non-negative integer")
    tok = tokenizer_fields(tokenizer_file(ap, a.tokenizer))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for t in types:
        cut = f"-{a.layers}l" if a.layers else ""
        path = a.out_dir / f"{a.shape}{cut}-random{'-pure' if a.pure else ''}.{t}.gguf"
        t0 = time.perf_counter()
        write(path, a.shape, t, a.seed, a.pure, tok, layers=a.layers)
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB  {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
