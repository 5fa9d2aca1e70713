"""The quantized-panel packer's numba kernel (`packing/repack.py`) against the NumPy packer it
replaced (`packref.py`): byte-identical panels for every native type, with row orders (Q/K
un-permutation), concatenated parts, partial panels, NaN scales (the float32 fallback), stacks of
layers, read-only mapped input and any thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import packref
from test_native import NATIVE, k_for, random_blocks
from tinydet.packing import layout
from tinydet.formats.gguf_model import rope_row_order
from tinydet.formats.ggml import GGML_TYPE_IDS

FIELDS = ("qs", "d", "m", "sc", "qh")


def assert_same_panels(got: layout.QPanels, want: layout.QPanels, what: str = "", layers: int = 0) -> None:
    assert (got.ggml_type, got.n, got.k) == (want.ggml_type, want.n, want.k), what
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        if b is None:
            assert a is None, f"{what} {f}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {f}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what} {f}: bytes differ"
    for one in [layout.layer_of(got, i) for i in range(layers)] if layers else [got]:
        one.check()


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_parts_equal_the_numpy_packer(name, nonfinite, restore_threads):
    """[q; k; v] with Q/K rows un-permuted, parts of 96, 40 and 37 rows (panels straddle parts, the
    last is partial), packed at 1, 2 and 3 threads: the NumPy packer's bytes."""
    tid = GGML_TYPE_IDS[name]
    k = k_for(name, 96)
    q = random_blocks(name, 96, k, seed=1, nonfinite=nonfinite)
    kk = random_blocks(name, 40, k, seed=2, nonfinite=nonfinite)
    v = random_blocks(name, 37, k, seed=3, nonfinite=nonfinite)
    orders = (rope_row_order(96, 6), rope_row_order(40, 2), None)
    want = packref.pack_parts([(q, orders[0]), (kk, orders[1]), (v, None)], tid, k)
    for threads in (1, 2, 3):
        numba.set_num_threads(threads)
        got = layout.pack_parts([(q, orders[0], tid), (kk, orders[1], tid), (v, None, tid)], tid, k)
        assert_same_panels(got, want, f"{name} threads={threads}")


@pytest.mark.parametrize("name", NATIVE)
def test_read_only_mapped_rows(name, tmp_path):
    """Rows read from a read-only memory map (as a GGUF tensor's bytes are) pack the same."""
    tid = GGML_TYPE_IDS[name]
    k = k_for(name, 64)
    raw = random_blocks(name, 70, k, seed=5)
    path = tmp_path / "rows.bin"
    raw.tofile(path)
    mapped = np.memmap(path, np.uint8, "r")
    assert not mapped.flags.writeable
    assert_same_panels(layout.pack_parts([(mapped, None, tid)], tid, k), packref.pack_parts([(raw, None)], tid, k))


@pytest.mark.parametrize("name", NATIVE)
def test_stack_equals_the_numpy_packer_per_layer(name):
    """pack_stack of 3 layers is each layer's NumPy packing, stacked; a signaling NaN scale in one
    layer is stored quieted, in that layer only."""
    tid = GGML_TYPE_IDS[name]
    k = k_for(name, 64)
    layers = [[random_blocks(name, 48, k, seed=10 + i), random_blocks(name, 24, k, seed=20 + i)] for i in range(3)]
    for poison in (False, True):
        if poison:
            off = {"Q6_K": 208}.get(name, 0)
            layers[1][1].reshape(24, -1, layout.GGML_TYPES[tid].type_size)[5, 0, off:off + 2] = \
                np.array([0x7C01], "<u2").view(np.uint8)
        done = []
        got = layout.pack_stack([[(a, None, tid), (b, None, tid)] for a, b in layers], tid, k, done=done.append)
        assert done == [0, 1, 2]
        want = layout.stack([packref.pack_parts([(a, None), (b, None)], tid, k) for a, b in layers])
        assert_same_panels(got, want, f"{name} poison={poison}", layers=3)
        assert got.d.dtype == (np.uint8 if name == "MXFP4" else np.uint16)  # E8M0 bytes, or fp16 bits


def test_stack_errors():
    raw = random_blocks("Q4_0", 64, 64, seed=1)
    tid = layout.Q4_0
    with pytest.raises(ValueError, match="differ"):
        layout.pack_stack([[(raw, None)], [(raw[:32], None)]], tid, 64)
    with pytest.raises(ValueError, match="share one type"):
        layout.pack_stack([[(raw, None, layout.Q8_0)]], tid, 64)


def test_signaling_nan_scales_are_quieted_as_the_numpy_packer_does():
    """The packer's kernel (`repack.quiet_snans`) sets the quiet bit of exactly the signaling NaN
    patterns, as the NumPy packer's mask does: every NaN pattern of both signs, and 2,000 others."""
    from tinydet.packing import repack

    rng = np.random.default_rng(0)
    nan = np.array([s | e for s in (0, 0x8000) for e in range(0x7C00, 0x8000)], np.uint16)
    vals = np.concatenate([nan, rng.integers(0, 1 << 16, 2000).astype(np.uint16)])
    bits = np.zeros((-(-vals.size // 32), 32), np.uint16)
    bits.reshape(-1)[:vals.size] = vals
    got = repack.quiet_snans(bits.copy())
    assert np.array_equal(got, packref._scale_storage(bits))
    snan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x0200) == 0) & ((bits & 0x01FF) != 0)
    assert np.array_equal(got != bits, snan) and ((got ^ bits)[snan] == 0x0200).all()
    assert snan.reshape(-1)[:nan.size].sum() == 2 * 511  # payloads 1..0x1FF, two signs
