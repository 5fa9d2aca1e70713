"""Hugging Face model directories: config.json, safetensors weights (one file or shards), tokenizer.json.

A directory is read as transformers' LlamaForCausalLM would read it, and brought to tinydet's
canonical names (weights.py). HF's Q/K row order (rotate-half) *is* the canonical layout, so nothing is
permuted; the output matrix is tied to the token embedding only when `lm_head.weight` is absent.

Safetensors layout: an 8-byte little-endian header length N, N bytes of JSON
(`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`), then the data, with
offsets relative to its start. The header is checked here (sizes, bounds, overlaps, gaps) before any
tensor byte is read, so a file that lies gives a ModelFormatError, never a NumPy traceback. F32 and
F16 tensors are read through `safetensors.safe_open(framework="numpy")`; NumPy has no bfloat16, so
BF16 tensors are read from a memory map of the validated byte range and widened exactly.

Pickle checkpoints (pytorch_model.bin, *.pt, *.pth) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .config import Config
from .errors import ModelFormatError
from .tokenizer import Tokenizer
from .weights import canonical_names, expected_shapes

__all__ = ["load_hf_dir", "read_hf_config", "read_hf_tokenizer", "SafetensorsFile", "bf16_to_f32", "HF_NAMES"]

HF_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "output": "lm_head.weight",
    "layers.{}.attention_norm": "model.layers.{}.input_layernorm.weight",
    "layers.{}.wq": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.wk": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.wv": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.wo": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.ffn_norm": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.w1": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.w2": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.w3": "model.layers.{}.mlp.up_proj.weight",
}

# Buffers some older checkpoints saved alongside the weights; recomputed from the config, never read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")

# Safetensors dtypes -> bits per element (the format's full list); tinydet loads the float ones below.
ST_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
LOADABLE_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


# ---------------------------------------------------------------------------------------------------
# Numbers


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly: bfloat16 is the high half of a float32, so
    widening is a 16-bit shift (NaN payloads, infinities and subnormals included)."""
    u = np.asarray(bits, dtype=np.uint16)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------------------------------------------
# Safetensors


@dataclass(frozen=True)
class STensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _reject_duplicates(path: Path, field: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise ModelFormatError(path, field, f"duplicate key {k!r} in the JSON")
            out[k] = v
        return out
    return hook


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile:
    """A safetensors file whose header has been validated: `tensors` maps names to `STensor`,
    `metadata` is the header's `__metadata__` (str -> str). `get(name)` returns float32."""

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        if not path.is_file():
            raise ModelFormatError(path, "path", "no such file")
        size = path.stat().st_size
        if size < 8:
            raise ModelFormatError(path, "header length",
                                   f"file is {size} bytes, too short for the 8-byte header length")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                raise ModelFormatError(
                    path, "header length",
                    f"says the JSON header is {n} bytes, but the file has {size - 8} bytes after the length "
                    f"(and a header is 2..{MAX_HEADER_BYTES} bytes): not a safetensors file, or truncated")
            raw = f.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(path, "header", f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.startswith("{"):
            raise ModelFormatError(path, "header", "does not start with '{': not a safetensors file")
        try:
            header = json.loads(text, object_pairs_hook=_reject_duplicates(path, "header"))
        except json.JSONDecodeError as e:
            raise ModelFormatError(path, "header", f"is not valid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(header, dict):
            raise ModelFormatError(path, "header", "expected a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise ModelFormatError(path, "__metadata__", "expected an object of string -> string")
        self.metadata: dict[str, str] = meta
        self.data_offset = data_start = 8 + n
        data_size = size - data_start

        tensors: dict[str, STensor] = {}
        spans = []
        for name, info in header.items():
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise ModelFormatError(path, name, "expected an object with exactly dtype, shape and data_offsets")
            dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or dtype not in ST_DTYPE_BITS:
                raise ModelFormatError(path, f"{name}.dtype",
                                       f"unknown dtype {dtype!r} (safetensors dtypes: {', '.join(ST_DTYPE_BITS)})")
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise ModelFormatError(path, f"{name}.shape", f"expected a list of non-negative integers, found {shape!r}")
            if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                    or not 0 <= offs[0] <= offs[1]):
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"expected [begin, end] with 0 <= begin <= end, found {offs!r}")
            bits = math.prod(shape) * ST_DTYPE_BITS[dtype]
            if bits % 8:
                raise ModelFormatError(path, f"{name}.shape", f"{shape} {dtype} elements do not fill whole bytes")
            begin, end = offs
            if end - begin != bits // 8:
                raise ModelFormatError(
                    path, f"{name}.data_offsets",
                    f"[{begin}, {end}) holds {end - begin} bytes, but shape {shape} of {dtype} needs {bits // 8}")
            if end > data_size:
                raise ModelFormatError(
                    path, f"{name}.data_offsets",
                    f"[{begin}, {end}) runs past the end of the data ({data_size} bytes after the header)")
            tensors[name] = STensor(name, dtype, tuple(shape), data_start + begin, end - begin)
            spans.append((begin, end, name))

        # The format requires the data to be exactly covered: sorted spans, no overlap, no gap.
        spans.sort()
        pos, prev = 0, None
        for begin, end, name in spans:
            if begin < pos:
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"[{begin}, {end}) overlaps tensor {prev!r}, which ends at {pos}")
            if begin > pos:
                raise ModelFormatError(path, f"{name}.data_offsets",
                                       f"starts at {begin}, leaving a gap of {begin - pos} bytes after "
                                       + (repr(prev) if prev else "the header"))
            pos, prev = end, name
        if pos != data_size:
            raise ModelFormatError(path, "data_offsets",
                                   f"tensors cover {pos} bytes but the file has {data_size} bytes of data "
                                   "(trailing bytes, or a truncated header)")
        self.tensors = tensors
        self._st = None
        self._map = None

    def get(self, name: str) -> np.ndarray:
        """The tensor as a C-contiguous float32 array (F16 and BF16 widened exactly)."""
        t = self.tensors[name]
        if t.dtype not in LOADABLE_DTYPES:
            raise ModelFormatError(self.path, f"{name}.dtype",
                                   f"dtype {t.dtype} is not supported (supported: {', '.join(LOADABLE_DTYPES)})")
        if t.dtype == "BF16":
            if self._map is None:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            bits = self._map[t.offset:t.offset + t.nbytes].view("<u2").reshape(t.shape)
            return bf16_to_f32(bits)
        try:
            if self._st is None:
                from safetensors import safe_open

                self._st = safe_open(str(self.path), framework="numpy")
            a = self._st.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - anything safetensors rejects is a format error
            raise ModelFormatError(self.path, name, f"safetensors could not read it: {_one_line(e)}") from None
        if a.shape != t.shape:
            raise ModelFormatError(self.path, name, f"read shape {a.shape}, header says {t.shape}")
        # F16 -> F32 is exact (every binary16 value is a float32 value).
        return np.ascontiguousarray(a, dtype=np.float32)


def _one_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


# ---------------------------------------------------------------------------------------------------
# JSON files


def _read_json(path: Path, field: str, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelFormatError(path, field, "missing")
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError(path, field, f"is not valid UTF-8 ({e.reason})") from None
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates(path, field))
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, field, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(path, field, "expected a JSON object")
    return data


# ---------------------------------------------------------------------------------------------------
# config.json


def read_hf_config(path: str | Path) -> tuple[Config, bool, dict]:
    """Config from a directory's config.json -> (Config, tie_word_embeddings, raw dict)."""
    cpath = Path(path) / CONFIG_FILE
    if not cpath.is_file():
        raise ModelFormatError(cpath, CONFIG_FILE, "missing: not a Hugging Face model directory")
    c = _read_json(cpath, CONFIG_FILE)

    def bad(field, msg):
        raise ModelFormatError(cpath, field, msg)

    model_type = c.get("model_type")
    archs = c.get("architectures")
    if model_type is not None and model_type != "llama":
        bad("model_type", f"model type {model_type!r} is not supported (supported: 'llama')")
    if model_type is None:
        if not isinstance(archs, list) or "LlamaForCausalLM" not in archs:
            bad("model_type", f"missing, and architectures is {archs!r}, not ['LlamaForCausalLM']: "
                              "only Llama models are supported")
    if isinstance(archs, list) and archs and not any(a == "LlamaForCausalLM" for a in archs):
        bad("architectures", f"{archs!r} has no LlamaForCausalLM: only causal language models are supported")

    def req_int(key, default=None):
        if key not in c or c[key] is None:
            if default is not None:
                return default
            bad(key, "required field is missing")
        v = c[key]
        if not _is_int(v):
            bad(key, f"expected an integer, found {v!r}")
        if v <= 0:
            bad(key, f"expected a positive integer, found {v!r}")
        return v

    def req_float(key, default=None):
        if key not in c or c[key] is None:
            if default is not None:
                return default
            bad(key, "required field is missing")
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(key, f"expected a number, found {v!r}")
        return float(v)

    dim = req_int("hidden_size")
    n_heads = req_int("num_attention_heads")
    n_kv = req_int("num_key_value_heads", n_heads)
    if dim % n_heads:
        bad("num_attention_heads", f"{n_heads} heads do not divide hidden_size {dim}")
    head_dim = dim // n_heads
    if c.get("head_dim") is not None and c["head_dim"] != head_dim:
        bad("head_dim", f"expected hidden_size / num_attention_heads = {head_dim}, found {c['head_dim']!r} "
                        "(a head dimension of its own is not supported)")
    if c.get("hidden_act", "silu") != "silu":
        bad("hidden_act", f"activation {c['hidden_act']!r} is not supported (supported: 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            bad(key, "biases are not supported")
    if c.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        bad("partial_rotary_factor", f"partial RoPE is not supported, found {c['partial_rotary_factor']!r}")

    # RoPE: transformers 4.x writes rope_theta (+ rope_scaling), 5.x writes rope_parameters.
    theta = req_float("rope_theta", 10000.0) if c.get("rope_theta") is not None else None
    for key in ("rope_scaling", "rope_parameters"):
        rp = c.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            bad(key, f"expected an object or null, found {rp!r}")
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default":
            bad(key, f"RoPE scaling {kind!r} is not supported (only plain RoPE: rope_scaling null)")
        extra = set(rp) - {"rope_type", "type", "rope_theta"}
        if extra:
            bad(key, f"RoPE parameters {sorted(extra)} are not supported")
        if rp.get("rope_theta") is not None:
            t = rp["rope_theta"]
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                bad(f"{key}.rope_theta", f"expected a number, found {t!r}")
            if theta is not None and float(t) != theta:
                bad(f"{key}.rope_theta", f"{t!r} disagrees with rope_theta {theta!r}")
            theta = float(t)
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        bad("tie_word_embeddings", f"expected true or false, found {tie!r}")

    cfg = Config(
        arch="llama",
        n_layers=req_int("num_hidden_layers"),
        dim=dim,
        ffn_dim=req_int("intermediate_size"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=req_int("vocab_size"),
        context_length=req_int("max_position_embeddings"),
        rope_base=10000.0 if theta is None else theta,
        rms_eps=req_float("rms_norm_eps"),
    )
    cfg.validate(cpath, {
        "n_layers": "num_hidden_layers", "dim": "hidden_size", "ffn_dim": "intermediate_size",
        "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "num_attention_heads",
        "vocab_size": "vocab_size", "context_length": "max_position_embeddings", "rope_base": "rope_theta",
        "rms_eps": "rms_norm_eps",
    })
    return cfg, tie, c


# ---------------------------------------------------------------------------------------------------
# Weight files


def _find_weight_files(path: Path) -> tuple[list[SafetensorsFile], Path]:
    """The directory's safetensors files (validated headers) and the file that lists them."""
    single, index = path / SAFETENSORS_FILE, path / INDEX_FILE
    if single.is_file():
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


def _load_weights(files: list[SafetensorsFile], cfg: Config, tie: bool, listing: Path,
                  progress: Callable[[int, int, str], None] | None) -> dict[str, np.ndarray]:
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.tensors:
            if name in where:
                raise ModelFormatError(f.path, name, f"tensor also stored in {where[name].path.name}")
            where[name] = f
    names = list(canonical_names(cfg))
    hf_of = {}
    for canon, key in names:
        hf_of[canon] = HF_NAMES[key].format(canon.split(".")[1]) if "{}" in key else HF_NAMES[key]
    known = set(hf_of.values())
    for name, f in where.items():
        if name not in known and not name.endswith(_IGNORED_SUFFIXES):
            raise ModelFormatError(f.path, name, "unexpected tensor: not part of a Llama model with this "
                                                 "config.json (biases, extra layers and other architectures "
                                                 "are not supported)")
    shapes = expected_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for done, (canon, _) in enumerate(names):
        hname = hf_of[canon]
        if progress is not None:
            progress(done, len(names), hname)
        f = where.get(hname)
        if f is None:
            if canon == "output":
                if tie:
                    continue  # tied below
                raise ModelFormatError(listing, hname, "required tensor is missing (and config.json's "
                                                       "tie_word_embeddings is false)")
            raise ModelFormatError(listing, hname, "required tensor is missing")
        t = f.tensors[hname]
        if t.shape != shapes[canon]:
            raise ModelFormatError(f.path, hname, f"expected shape {shapes[canon]} from config.json, found {t.shape}")
        out[canon] = f.get(hname)
    if "output" not in out:
        out["output"] = out["tok_embeddings"]
    if progress is not None:
        progress(len(names), len(names), "")
    return out


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict, or null."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return ""  # malformed: the caller reports it


def _chat_template(v: Any, path: Path) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                   and isinstance(t.get("template"), str) for t in v):
        by_name = {t["name"]: t["template"] for t in v}
        return by_name.get("default", v[0]["template"] if v else None)
    raise ModelFormatError(path, "chat_template", "expected a string or a list of {name, template} objects")


def _id_list(v: Any, path: Path, field: str, n: int) -> list[int]:
    ids = v if isinstance(v, list) else [v]
    for i in ids:
        if not _is_int(i):
            raise ModelFormatError(path, field, f"expected a token id or a list of them, found {v!r}")
        if not 0 <= i < n:
            raise ModelFormatError(path, field, f"token id {i} is outside the vocabulary (0..{n - 1})")
    return list(ids)


def read_hf_tokenizer(path: str | Path, raw_config: dict | None = None) -> Tokenizer:
    """Tokenizer from tokenizer.json, with BOS/EOS, their insertion and the chat template from
    tokenizer_config.json, generation_config.json (and config.json's ids as a fallback)."""
    import tokenizers

    path = Path(path)
    tpath = path / TOKENIZER_FILE
    if not tpath.is_file():
        extra = " (a SentencePiece tokenizer.model alone is not supported)" if (path / "tokenizer.model").exists() else ""
        raise ModelFormatError(tpath, TOKENIZER_FILE, f"missing: tinydet needs a fast tokenizer file{extra}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(tpath))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions on bad files
        raise ModelFormatError(tpath, TOKENIZER_FILE, f"does not parse as a tokenizers file: {_one_line(e)}") from None
    n = hf.get_vocab_size(with_added_tokens=True)

    tcpath = path / TOKENIZER_CONFIG_FILE
    tc = _read_json(tcpath, TOKENIZER_CONFIG_FILE, required=False) or {}
    gcpath = path / GENERATION_CONFIG_FILE
    gc = _read_json(gcpath, GENERATION_CONFIG_FILE, required=False) or {}
    cc = raw_config or {}
    ccpath = path / CONFIG_FILE

    def token_id(key) -> int | None:
        text = _token_text(tc.get(key))
        if text is None:
            return None
        if text == "":
            raise ModelFormatError(tcpath, key, f"expected a token string or an AddedToken object, found {tc[key]!r}")
        tid = hf.token_to_id(text)
        if tid is None:
            raise ModelFormatError(tcpath, key, f"token {text!r} is not in tokenizer.json's vocabulary")
        return tid

    bos_id = token_id("bos_token")
    if bos_id is None:
        for src, p in ((gc, gcpath), (cc, ccpath)):
            if src.get("bos_token_id") is not None:
                bos_id = _id_list(src["bos_token_id"], p, "bos_token_id", n)[0]
                break
    eos_ids: list[int] = []
    tc_eos = token_id("eos_token")
    if tc_eos is not None:
        eos_ids.append(tc_eos)
    for src, p in ((gc, gcpath), (cc, ccpath)):
        if src.get("eos_token_id") is not None:
            eos_ids += _id_list(src["eos_token_id"], p, "eos_token_id", n)
            break

    # Whether BOS/EOS are added: tokenizer_config.json's flags when it has them, else what
    # tokenizer.json's post-processor does (which is what transformers then does too).
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    pre, post = [], []
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            pre, post = full[:k], full[k + len(plain):]
            break
    flags = {}
    for key, inferred, tid in (("add_bos_token", pre == [bos_id], bos_id),
                               ("add_eos_token", post == [eos_ids[0]] if eos_ids else False, None)):
        v = tc.get(key)
        if v is None:
            flags[key] = inferred
        elif not isinstance(v, bool):
            raise ModelFormatError(tcpath, key, f"expected true or false, found {v!r}")
        else:
            flags[key] = v
    if flags["add_bos_token"] and bos_id is None:
        raise ModelFormatError(tcpath, "add_bos_token", "is true but no BOS token is defined")
    if flags["add_eos_token"] and not eos_ids:
        raise ModelFormatError(tcpath, "add_eos_token", "is true but no EOS token is defined")

    tok = Tokenizer.from_hf(hf, bos_id=bos_id, eos_ids=eos_ids,
                            add_bos=flags["add_bos_token"], add_eos=flags["add_eos_token"])
    jinja = path / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        tok.chat_template = jinja.read_text(encoding="utf-8")
    else:
        tok.chat_template = _chat_template(tc.get("chat_template"), tcpath)
    for attr, key in (("unk_id", "unk_token"), ("pad_id", "pad_token")):
        text = _token_text(tc.get(key))
        if text:
            setattr(tok, attr, hf.token_to_id(text))
    return tok


# ---------------------------------------------------------------------------------------------------


def load_hf_dir(path: str | Path, progress: Callable[[int, int, str], None] | None = None
                ) -> tuple[Config, dict[str, np.ndarray], Tokenizer, dict]:
    """Load a Hugging Face Llama directory -> (Config, float32 weights under canonical names,
    Tokenizer, metadata). `progress(done, total, name)` is called before each tensor and once at the
    end, as `weights.load_gguf_weights` does."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(path, "path", "not a directory")
    cfg, tie, raw = read_hf_config(path)
    files, listing = _find_weight_files(path)
    tokenizer = read_hf_tokenizer(path, raw)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelFormatError(path / TOKENIZER_FILE, TOKENIZER_FILE,
                               f"{tokenizer.vocab_size} tokens but config.json's vocab_size is {cfg.vocab_size}")
    weights = _load_weights(files, cfg, tie, listing, progress)
    metadata = {
        "format": "huggingface",
        "config": raw,
        "files": [f.path.name for f in files],
        "safetensors_metadata": files[0].metadata if len(files) == 1 else {f.path.name: f.metadata for f in files},
    }
    return cfg, weights, tokenizer, metadata

