"""The integer mode's kinds of mixed types (backends/cpu/intmixed.py): each segment of a MixedPanels in
dtype "int8" gives, row for row, the bits of the independent NumPy reference of its own type's integer
rule (intref.py) for that segment alone, and a float segment the bits of the float32 product; decode and
prefill, 1 to 70 tokens, 1 and 2 threads. A tiny Q4_K_M file (llama-quantize's type choices: attn_v and
ffn_down Q6_K in some layers) runs every kind in integers, gives the same bits in every cell of the
determinism matrix, and its packed panels survive the panel cache."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import intref
import tinydet
from benchmods import bench_module
from test_intdot import tricky_rows
from test_native import assert_same_bits, fp32_product, mixed_segment, random_blocks
from tinydet.backends.cpu import loaders
from tinydet.packing import layout, panelcache
from tinydet.packing.intpanels import IntPanels
from tinydet.backends.cpu.matmul import MM_GLU, MM_PLAIN, mm, scratch
from tinydet.backends.cpu.ops import SILU, glu_rows
from tinydet.backends.cpu.storage.kinds import as_storage
from tinydet.packing.weights import _integer
from tinydet.formats.ggml import GGML_TYPE_IDS

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
MIXES = {
    # a Q4_K_M file's ffn_down (a type per layer) and wqkv (v Q6_K after q and k Q4_K), runs both ways
    "Q4_K+Q6_K": (512, [[("Q4_K", 256)], [("Q6_K", 256)], [("Q4_K", 192), ("Q6_K", 64)],
                        [("Q6_K", 64), ("Q4_K", 128), ("Q6_K", 64)]]),
    # [wq; wk] Q5_0 and wv Q8_0; a last panel only partly filled (198 rows)
    "Q5_0+Q8_0": (160, [[("Q5_0", 128), ("Q8_0", 70)], [("Q8_0", 64), ("Q5_0", 134)], [("Q5_0", 198)]]),
    # both activation block sizes in one kind, and float parts (F16 rows, F32 rows)
    "Q4_K+Q8_0+f16+f32": (256, [[("f16", 64), ("Q4_K", 64), ("Q8_0", 70)], [("Q6_K", 128), ("f32", 70)],
                                [("Q5_0", 198)]]),
}


@numba.njit
def _mixed_mm(x, w, li, n, out, nth, mode, act, kind):
    mm(x, loaders.layer(w, li), n, out, nth, mode, out, act, kind, scratch(nth, x.shape[1]))


def segment(name: str, rows: int, k: int, seed: int):
    """((key, rows, make) for layout.pack_mixed, ref(x) -> the segment's reference product)."""
    if name in ("f16", "f32"):
        seg, w = mixed_segment(name, rows, k, seed)
        return seg, lambda x: fp32_product(x, w)
    tid, raw = GGML_TYPE_IDS[name], random_blocks(name, rows, k, seed)
    ref = intref.k_product if name in K_TYPES else intref.product
    return (tid, rows, lambda: layout.pack_quantized(raw, tid, k)), lambda x: ref(x, raw, name, rows, k)


@pytest.mark.parametrize("mix", list(MIXES))
def test_each_segment_has_its_own_types_bits(mix, restore_threads):
    k, plan = MIXES[mix]
    segs = [[segment(name, rows, k, seed=10 * li + s) for s, (name, rows) in enumerate(layer)]
            for li, layer in enumerate(plan)]
    native = layout.pack_mixed([[seg for seg, _ in layer] for layer in segs], k)
    mp = _integer(native)
    assert mp.type_name == "+".join(p if p in ("f16", "f32") else p + ":int8" for p in native.type_name.split("+"))
    assert any(isinstance(p, IntPanels) for p in mp.parts) and mp.nbytes == native.nbytes
    mp.check()
    st = as_storage(mp)
    n = mp.n
    rng = np.random.default_rng(4)
    for li, layer in enumerate(segs):
        x = tricky_rows(rng, 70, k)
        x[1] *= np.float32(1e-3)  # rows of other magnitudes beside the tricky ones
        want = np.concatenate([ref(x) for _, ref in layer], axis=1)
        for T in (1, 2, 5, 70):
            for threads in (1, 2):
                got = np.full((T, n), np.nan, np.float32)
                _mixed_mm(x[:T], st, li, n, got, threads, MM_PLAIN, got, SILU)
                assert_same_bits(got, want[:T], f"{mix} layer {li} T={T} threads={threads}")
        # a row alone (decode) gives its bits within a prompt (prefill)
        got = np.empty((1, n), np.float32)
        _mixed_mm(x[40:41], st, li, n, got, 2, MM_PLAIN, got, SILU)
        assert_same_bits(got, want[40:41], f"{mix} layer {li} row 40 alone")
        ffn = n // 2
        if ffn % 64 == 0:  # [gate | up] from different segments: the fused activation of the products
            act = np.full((5, ffn), np.nan, np.float32)
            gu = np.empty((5, n), np.float32)
            _mixed_mm(x[:5], st, li, n, gu, 2, MM_GLU, act, SILU)
            want_act = np.empty((5, ffn), np.float32)
            glu_rows(np.ascontiguousarray(want[:5]), ffn, want_act, SILU)
            assert_same_bits(act, want_act, f"{mix} layer {li} GLU")


def test_a_kind_without_integer_parts_stays_native():
    seg, _ = mixed_segment("f16", 64, 64, 0)
    seg2, _ = mixed_segment("f32", 64, 64, 1)
    mp = layout.pack_mixed([[seg], [seg2]], 64)
    assert _integer(mp) is mp


# --- a tiny Q4_K_M file ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory, stories_path):
    """The tiny shape (2 layers, dim 256, FFN 512) as llama-quantize makes a Q4_K_M: layer 1's attn_v and
    ffn_down Q6_K, the rest Q4_K, the output Q6_K; stories260K's tokenizer."""
    mk = bench_module("make_random_gguf")
    path = tmp_path_factory.mktemp("q4km") / "tiny.Q4_K_M.gguf"
    mk.write(path, "tiny", "Q4_K_M", 0, False, mk.tokenizer_fields(stories_path), log=lambda *a: None)
    return path


def test_q4_k_m_every_product_in_integers(q4_k_m, restore_threads):
    from tinydet.tools.verify import run_matrix

    int8 = tinydet.load(q4_k_m, dtype="int8", panel_cache=False)
    st = int8.backend.storage()
    assert st["wqkv"] == st["w2"] == "Q4_K:int8+Q6_K:int8", st
    assert (st["wo"], st["w13"], st["output"]) == ("Q4_K:int8", "Q4_K:int8", "Q6_K:int8"), st
    ids = int8.tokenize("Once upon a time, there was a little girl named Lily")
    cells = run_matrix(lambda d, t: int8, q4_k_m, ids, 6, dtypes=("int8",), subprocesses=False)
    bad = [(c.group, c.variant) for c in cells if not c.ok]
    assert len(cells) > 10 and not bad, bad
    native = tinydet.load(q4_k_m, dtype="native", panel_cache=False)
    assert native.backend.storage()["wqkv"] == "Q4_K+Q6_K"
    a, b = int8.logits(ids), native.logits(ids)
    err = np.abs(a - b).max() / np.abs(b).max()
    print(f"tiny Q4_K_M: max |int8 - native| / max |native| = {err:.3g}")
    assert 0 < err < 0.1


def test_q4_k_m_panel_cache_round_trip(q4_k_m, tmp_path, monkeypatch):
    from test_panelcache import assert_same_weights

    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(panelcache.ENV_OFF, raising=False)
    plain = tinydet.load(q4_k_m, dtype="int8", panel_cache=False)
    tinydet.load(q4_k_m, dtype="int8")  # packs and writes
    panelcache.wait()  # written in the background
    assert len(list((tmp_path / "cache" / "panels").glob("*.tdp"))) == 1
    reads, real_read = [], panelcache.read
    monkeypatch.setattr(panelcache, "read", lambda *a: reads.append(real_read(*a)) or reads[-1])
    cached = tinydet.load(q4_k_m, dtype="int8")
    assert reads and reads[-1] is not None  # from the file, not packed again
    w = cached.backend.weights
    assert isinstance(w.wqkv, layout.MixedPanels) and any(isinstance(p, IntPanels) for p in w.wqkv.parts)
    assert cached.backend.storage() == plain.backend.storage()
    assert_same_weights(w, plain.backend.weights)
    ids = plain.tokenize("Once upon a time")
    assert np.array_equal(cached.logits(ids).view(np.uint32), plain.logits(ids).view(np.uint32))
