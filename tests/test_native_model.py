"""dtype="native": each matrix kept as the file stores it (Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks
dequantized inside the kernels, F16 widened exactly, kinds of mixed types kept per type, other types
dequantized at load) must give fp32's bits: the same logits, token by token and prompt at once, at any
thread count, traced or not."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import ggufgen as G
import tinydet
from tinydet.cli import main
from tinydet.formats.ggml import GGML_TYPE_IDS
from tinydet.tools.trace import run_trace

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) quantizes the test models")

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_same_logits(native, fp32, ids, chunk=None):
    """Logits of every position, whole prompt or in chunks, bit for bit."""
    a = native.logits(ids)
    b = fp32.logits(ids)
    assert np.array_equal(bits(a), bits(b)), f"max |native - fp32| = {np.abs(a - b).max()}"
    if chunk:
        backend = native.backend
        cache = backend.new_cache(len(ids))
        rows = [backend.forward(ids[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)]
        assert np.array_equal(bits(np.concatenate(rows)), bits(b))


def requantized(tmp_path, stories_path, plan, name="q.gguf"):
    """stories260K with its matrices stored as plan(tensor name) says: a ggml type name, or None to
    keep F32. Rows whose length is not a multiple of 32 (ffn_down: 172) stay F32, as in llama.cpp."""
    def edit(tensors):
        out = []
        for tname, shape, tid, raw in tensors:
            want = plan(tname)
            if want is None or len(shape) != 2 or shape[-1] % 32:
                out.append((tname, shape, tid, raw))
                continue
            w = np.frombuffer(raw, np.float32).reshape(shape)
            if want == "F16":
                data = w.astype(np.float16).tobytes()
            else:
                data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[want]).tobytes()
            out.append((tname, shape, GGML_TYPE_IDS[want], data))
        return out

    p = tmp_path / name
    p.write_bytes(G.rewrite(stories_path, tensor_edits=edit))
    return p


def layer_of(tname: str) -> int | None:
    return int(tname.split(".")[1]) if tname.startswith("blk.") else None


PLANS = {
    "Q8_0": lambda t: "Q8_0",
    "Q4_0": lambda t: "Q4_0",
    "Q4_1": lambda t: "Q4_1",
    "F16": lambda t: "F16",
    # a real file's mix: quantized layers, Q8_0 token table, F16 output
    "Q4_1 + Q8_0 table + F16 output": lambda t: {"token_embd.weight": "Q8_0", "output.weight": "F16"}.get(t, "Q4_1"),
    "Q5_0": lambda t: "Q5_0",
    "MXFP4": lambda t: "MXFP4",
    "mixed per layer, MXFP4": lambda t: ("MXFP4" if layer_of(t) % 2 else "Q8_0") if layer_of(t) is not None else None,
    # types that differ between layers, or between runs of [wq; wk; wv] starting at multiples of 64
    # rows (wq: rows 0..63), stay as stored (MixedPanels)
    "mixed per layer": lambda t: ("Q4_0" if layer_of(t) % 2 else "Q8_0") if layer_of(t) is not None else None,
    "mixed runs in qkv": lambda t: ("Q8_0" if "attn_q" in t else "Q4_0") if layer_of(t) is not None else None,
    # runs that do not start at a multiple of 64 rows (wk: rows 64..95) are dequantized for that kind
    "mixed within qkv": lambda t: "Q8_0" if "attn_k" in t else ("Q4_1" if layer_of(t) is not None else None),
    "Q5_1": lambda t: "Q5_1",
    # a type without a native kernel: dequantized to float32
    "BF16": lambda t: "BF16",
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_native_equals_fp32_on_requantized_stories(tmp_path, stories_path, plan):
    path = requantized(tmp_path, stories_path, PLANS[plan])
    fp32 = tinydet.load(path, dtype="fp32", threads=2)
    native = tinydet.load(path, dtype="native", threads=2)
    ids = native.tokenize(PROMPT)
    assert_same_logits(native, fp32, ids, chunk=5)
    stored = native.backend.storage()
    if plan in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"):
        assert stored["wqkv"] == stored["wo"] == stored["w13"] == stored["output"] == plan
        assert stored["w2"] == "f32"  # 172-long rows stay F32 in the file
    if plan == "F16":
        assert set(stored.values()) <= {"f16", "f32"} and stored["wqkv"] == "f16"
    if plan.startswith("Q4_1 +"):
        assert (stored["tok_embeddings"], stored["output"], stored["wqkv"]) == ("Q8_0", "f16", "Q4_1")
    if plan == "mixed per layer":
        assert stored["wqkv"] == stored["wo"] == stored["w13"] == "Q4_0+Q8_0" and stored["w2"] == "f32"
    if plan == "mixed runs in qkv":
        assert (stored["wqkv"], stored["wo"]) == ("Q4_0+Q8_0", "Q4_0")
    if plan == "mixed within qkv":
        assert (stored["wqkv"], stored["wo"]) == ("f32", "Q4_1")
    if plan == "BF16":
        assert set(stored.values()) == {"f32"}
    for threads in (1, 3):
        native.threads = threads
        g = native.generate(PROMPT, max_tokens=12)
        want = fp32.generate(PROMPT, max_tokens=12)
        assert (g.output_hash, g.logits_hash) == (want.output_hash, want.logits_hash)


def test_native_trace_equals_fp32_trace(tmp_path, stories_path):
    """The traced pass (a hook after every op, fusions undone) records the same bits op by op."""
    path = requantized(tmp_path, stories_path, PLANS["Q4_1 + Q8_0 table + F16 output"])
    models = [tinydet.load(path, dtype=d, threads=2) for d in ("native", "fp32")]
    ids = models[0].tokenize(PROMPT)
    traces = [run_trace(m, ids, chunk=4, keep_values=False) for m in models]
    key = lambda r: (r["layer"], r["op"], r["pos"], r["slot"], r["sha256"])  # noqa: E731
    a, b = ([key(r) for r in t.records] for t in traces)
    assert len(a) > 100 and a == b


def test_native_smollm_bit_identical_and_smaller(smollm_models):
    native, fp32 = smollm_models("native"), smollm_models("fp32")
    stored = native.backend.storage()
    assert stored == {"wqkv": "Q4_1", "wo": "Q4_1", "w13": "Q4_1", "w2": "Q4_1", "output": "Q8_0",
                      "tok_embeddings": "Q8_0"}
    # one Q8_0 table serves the embedding and the tied output
    assert native.backend.weights.output is native.backend.weights.table
    # Q4_1 layers (5 bits a weight) and the Q8_0 table (8.5 bits), against 32 bits
    assert native.backend.weight_bytes() < 0.19 * fp32.backend.weight_bytes()
    ids = native.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    assert_same_logits(native, fp32, ids, chunk=7)
    g, want = native.generate(ids, max_tokens=24), fp32.generate(ids, max_tokens=24)
    assert (g.output_hash, g.logits_hash) == (want.output_hash, want.logits_hash)
    batch = native.generate_batch([{"prompt": ids, "max_tokens": 24}, {"prompt": "Hi", "max_tokens": 5}])
    assert batch[0].logits_hash == want.logits_hash


def test_native_cli(stories_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(stories_path), "--dtype", "native", "--max-tokens", "8",
                                  "--json", "Once upon a time"])
    assert r.exit_code == 0, r.output
    want = CliRunner().invoke(main, ["generate", "--model", str(stories_path), "--max-tokens", "8", "--json",
                                     "Once upon a time"])
    a, b = (json.loads(x.stdout) for x in (r, want))
    assert (a["output_hash"], a["logits_hash"]) == (b["output_hash"], b["logits_hash"])


def test_native_hf_directory(tmp_path, stories_path):
    """A Hugging Face directory has nothing quantized: native stores its matrices as float32."""
    from tinydet.tools.convert import convert_gguf_to_hf

    out = convert_gguf_to_hf(stories_path, tmp_path / "hf")
    native = tinydet.load(out, dtype="native", threads=2)
    fp32 = tinydet.load(out, dtype="fp32", threads=2)
    assert set(native.backend.storage().values()) == {"f32"}
    assert_same_logits(native, fp32, native.tokenize(PROMPT))


def test_verify_holds_native_to_fp32(tmp_path, stories_path):
    """`tinydet verify` compares native cells with fp32's baseline: a native kernel that is off by
    an ulp fails every native cell (the fault injected through the backend's documented op hooks)."""
    from tinydet.tools.verify import run_matrix

    path = requantized(tmp_path, stories_path, PLANS["Q4_1"])

    def off_by_an_ulp(layer, op, pos, slots, rows):
        if op in ("q", "k", "v", "attn_output", "gate", "up"):  # products of the Q4_1 matrices
            rows[:] = np.nextafter(rows, np.float32(np.inf))

    def load(dtype, threads):
        model = tinydet.load(path, dtype=dtype, threads=threads)
        if dtype == "native":
            model.backend.hooks.append(off_by_an_ulp)
        return model

    cells = run_matrix(load, path, [1, 403, 407], 3, dtypes=("fp32", "native"), subprocesses=False)
    assert all(c.ok for c in cells if c.dtype == "fp32")
    assert not any(c.ok for c in cells if c.dtype == "native")


def test_mxfp4_tiny_model_native_gives_fp32_bits_and_loads_in_int8(tmp_path):
    """A tiny Qwen2 whose every matrix (token table and output too) is MXFP4: native storage keeps the
    blocks and gives fp32's logits bit for bit, whole prompt and in chunks; the memory estimate counts
    the file's bytes; int8 computes the blocks in integers, close to native."""
    from qwen2gen import write_gguf
    from tinydet import memory
    from tinydet.formats import open_checkpoint

    path = write_gguf(tmp_path / "mx.gguf", quant="mxfp4")
    fp32 = tinydet.load(path, dtype="fp32", threads=2)
    native = tinydet.load(path, dtype="native", threads=2)
    int8 = tinydet.load(path, dtype="int8", threads=2)
    assert set(native.backend.storage().values()) == {"MXFP4"}
    st = int8.backend.storage()
    assert st.pop("tok_embeddings") == "MXFP4" and set(st.values()) == {"MXFP4:int8"}  # the table's rows: dequantized
    ids = list(range(3, 40))
    assert_same_logits(native, fp32, ids, chunk=5)
    tensors = open_checkpoint(path).tensors
    est = memory.weight_bytes(tensors, "native")
    assert abs(est - native.backend.weight_bytes()) <= 0.01 * native.backend.weight_bytes()
    assert est < 0.2 * memory.weight_bytes(tensors, "fp32") and est == memory.weight_bytes(tensors, "int8")
    a, b = int8.logits(ids), native.logits(ids)
    assert np.isfinite(a).all() and 0 < np.abs(a - b).max() < 0.1 * np.abs(b).max()
