"""Packed panels kept on disk (`packing/panelcache.py`): a cached load gives the packed load's
arrays byte for byte and its logits bit for bit; a corrupt, truncated or stale file is detected,
removed and rebuilt, never used; the model is not rehashed when its stat is unchanged; the cache can be
turned off, and a disk that refuses the file gives a warning and a normal load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import tinydet
from test_native_model import requantized
from tinydet.packing import panelcache
from tinydet.packing.intpanels import IntPanels
from tinydet.packing.layout import MixedPanels, QPanels

# Mixed storage: Q8_0 attention, Q4_0 elsewhere (a 172-long ffn_down row stays F32: float panels)
PLAN = lambda t: "Q8_0" if "attn" in t else "Q4_0"  # noqa: E731


@pytest.fixture
def model_file(tmp_path, stories_path, monkeypatch):
    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(panelcache.ENV_OFF, raising=False)
    return requantized(tmp_path, stories_path, PLAN)


def arrays(w) -> list[np.ndarray]:
    out = []
    for name in sorted(vars(w)):
        v = getattr(w, name)
        out += [v] if isinstance(v, np.ndarray) else v.arrays()
    return out


def assert_same_weights(a, b) -> None:
    assert sorted(vars(a)) == sorted(vars(b))
    for name in vars(a):
        x, y = getattr(a, name), getattr(b, name)
        assert type(x) is type(y), name
        if isinstance(x, (QPanels, IntPanels)):
            assert (x.ggml_type, x.n, x.k) == (y.ggml_type, y.n, y.k), name
        if isinstance(x, MixedPanels):
            assert (x.n, x.k, len(x.parts)) == (y.n, y.k, len(y.parts)), name
    xs, ys = arrays(a), arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous and y.flags.c_contiguous
        assert x.flags.writeable and y.flags.writeable  # the kernels are compiled for writable arrays
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert a.table is a.output if b.table is b.output else a.table is not a.output


def cache_files(tmp_path):
    panelcache.wait()  # loads write their files in the background
    return sorted((tmp_path / "cache" / "panels").glob("*.tdp"))


@pytest.mark.parametrize("dtype", ["native", "int8"])
def test_cached_load_is_the_packed_load(model_file, tmp_path, monkeypatch, dtype):
    plain = tinydet.load(model_file, dtype=dtype, panel_cache=False)
    assert cache_files(tmp_path) == []
    first = tinydet.load(model_file, dtype=dtype)  # packs and writes
    (path,) = cache_files(tmp_path)
    reads = []
    real_read = panelcache.read
    monkeypatch.setattr(panelcache, "read", lambda *a: reads.append(real_read(*a)) or reads[-1])
    # the stat index names the model's SHA-256: no rehash
    monkeypatch.setattr(panelcache, "file_sha256", lambda p: pytest.fail("rehashed an unchanged model"))
    monkeypatch.setattr(tinydet.hashing, "file_sha256", lambda p: pytest.fail("rehashed an unchanged model"))
    second = tinydet.load(model_file, dtype=dtype)
    assert second.sha256 == first.sha256  # the model's own SHA-256 from the index too
    assert reads and reads[-1] is not None
    assert isinstance(second.backend.weights.wo, IntPanels if dtype == "int8" else QPanels)
    assert_same_weights(second.backend.weights, plain.backend.weights)
    assert_same_weights(first.backend.weights, plain.backend.weights)
    ids = second.tokenize("Once upon a time")
    want = plain.logits(ids)
    assert np.array_equal(second.logits(ids).view(np.uint32), want.view(np.uint32))
    assert cache_files(tmp_path) == [path]


def test_load_does_not_wait_for_the_write(model_file, tmp_path, monkeypatch):
    """The packed model is returned while its file is written; generating meanwhile gives the same bits,
    and a second load in the process waits for the file rather than packing again."""
    gate, real_write = threading.Event(), panelcache.write
    monkeypatch.setattr(panelcache, "write", lambda *a: gate.wait(120) and real_write(*a))
    plain = tinydet.load(model_file, dtype="native", panel_cache=False)
    m = tinydet.load(model_file, dtype="native")
    assert list((tmp_path / "cache" / "panels").glob("*.tdp")) == []  # still held at the gate
    ids = m.tokenize("Once upon a time")
    assert np.array_equal(m.logits(ids).view(np.uint32), plain.logits(ids).view(np.uint32))
    gate.set()
    monkeypatch.setattr(panelcache, "read", lambda *a, real=panelcache.read: real(*a) or pytest.fail("packed again"))
    again = tinydet.load(model_file, dtype="native")
    assert_same_weights(again.backend.weights, plain.backend.weights)
    assert len(cache_files(tmp_path)) == 1


def test_process_that_exits_at_once_leaves_a_whole_file(model_file, tmp_path):
    """A command that ends right after the load (the file still being written) waits for it at exit,
    also when the load ran in a daemon thread (as `tinydet serve` loads)."""
    code = ("import threading, time, tinydet\n"
            "from tinydet.packing import panelcache\n"
            "real = panelcache.write\n"
            "panelcache.write = lambda *a: time.sleep(2) or real(*a)  # still writing when the main thread ends\n"
            f"t = threading.Thread(target=tinydet.load, args=({str(model_file)!r},), kwargs={{'dtype': 'native'}}, daemon=True)\n"
            "t.start(); t.join()\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (path,) = cache_files(tmp_path)
    sha = tinydet.hashing.model_sha256(model_file)
    assert panelcache.read(path, panelcache._key(sha, "native")) is not None
    assert list(path.parent.glob("*.tmp")) == []


def _build(model_file):
    """(key, path, packed weights) of the test model, the file written."""
    m = tinydet.load(model_file, dtype="native", panel_cache=False)
    sha = tinydet.hashing.model_sha256(model_file)
    key, path = panelcache._key(sha, "native"), panelcache.cache_path(sha, "native")
    panelcache.write(path, key, m.backend.weights)
    return key, path, m.backend.weights


@pytest.mark.parametrize("damage", ["data byte", "last byte", "header byte", "truncated", "empty", "magic"])
def test_damaged_file_is_removed_not_used(model_file, damage):
    key, path, w = _build(model_file)
    assert_same_weights(w.restore(panelcache.read(path, key)), w)
    raw = bytearray(path.read_bytes())
    start = json.loads(raw[panelcache._PREFIX.size:panelcache._PREFIX.size + 100000].split(b"\0")[0])["data_offset"] \
        if damage != "header byte" else 0
    if damage == "data byte":
        raw[start + 12345] ^= 0x10
    elif damage == "last byte":
        raw[-1] ^= 0x01
    elif damage == "header byte":
        raw[panelcache._PREFIX.size + 20] ^= 0x01
    elif damage == "truncated":
        raw = raw[:-4096]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[0:8] = b"TDPANEL0"
    path.write_bytes(bytes(raw))
    assert panelcache.read(path, key) is None
    assert not path.exists()


def test_stale_key_is_not_used(model_file):
    key, path, w = _build(model_file)
    for field, value in (("source", "0" * 64), ("model_sha256", "1" * 64), ("dtype", "fp32")):
        if not path.exists():
            panelcache.write(path, key, w)
        assert panelcache.read(path, {**key, field: value}) is None, field
        assert not path.exists()


def test_damaged_file_is_rebuilt_on_load(model_file, tmp_path):
    plain = tinydet.load(model_file, dtype="native", panel_cache=False)
    tinydet.load(model_file, dtype="native")
    (path,) = cache_files(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = tinydet.load(model_file, dtype="native")  # detected, packed, written again
    assert_same_weights(again.backend.weights, plain.backend.weights)
    (path2,) = cache_files(tmp_path)
    assert path2 == path and path.read_bytes() != bytes(raw)


def test_changed_model_file_is_rehashed(model_file, tmp_path):
    tinydet.load(model_file, dtype="native")
    data = bytearray(model_file.read_bytes())
    model_file.write_bytes(bytes(data))  # same bytes, new mtime: rehashed, same SHA-256, same file
    tinydet.load(model_file, dtype="native")
    assert len(cache_files(tmp_path)) == 1
    index = json.loads((tmp_path / "cache" / "sha256-index.json").read_text())
    assert len(index) == 2 and len(set(index.values())) == 1


def test_turned_off(model_file, tmp_path, monkeypatch):
    tinydet.load(model_file, dtype="native", panel_cache=False)
    monkeypatch.setenv(panelcache.ENV_OFF, "1")
    tinydet.load(model_file, dtype="native")
    assert not (tmp_path / "cache" / "panels").exists()
    tinydet.load(model_file, dtype="native", panel_cache=True)
    assert len(cache_files(tmp_path)) == 1


def test_unwritable_cache_warns_and_loads(model_file, tmp_path, monkeypatch, capsys):
    def refuse(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(panelcache, "write", refuse)
    m = tinydet.load(model_file, dtype="native")
    assert m.backend.weights.wqkv is not None
    panelcache.wait()
    err = capsys.readouterr().err
    assert "not cached (No space left on device)" in err and err.count("\n") == 1
    assert cache_files(tmp_path) == []


def test_large_dtype_is_not_cached(model_file, tmp_path):
    """fp32 panels of a 4-bit file would take several times its size on disk: not kept."""
    tinydet.load(model_file, dtype="fp32")
    assert cache_files(tmp_path) == []


def test_checksum_sees_every_word():
    data = np.zeros(3 << 20, np.uint8)
    base = panelcache.checksum(data)
    for pos in (0, 7, (1 << 20) + 3, data.size - 1):
        d = data.copy()
        d[pos] = 1
        assert panelcache.checksum(d) != base, pos
    swapped = np.arange(64, dtype=np.uint64).view(np.uint8).copy()
    moved = swapped.view(np.uint64)[::-1].copy().view(np.uint8)
    assert panelcache.checksum(swapped) != panelcache.checksum(moved)


def test_packing_reports_progress(model_file):
    """Each matrix kind packed is reported, ending at done == total."""
    calls = []
    tinydet.load(model_file, dtype="native", panel_cache=False, progress=lambda *a: calls.append(a))
    packing = [c for c in calls if c[2].startswith("packing ")]
    assert [c[0] for c in packing] == list(range(1, packing[-1][1] + 1))
    assert packing[-1][0] == packing[-1][1] == 5


def test_progress_line_only_on_a_terminal_after_a_second(monkeypatch):
    import io

    from tinydet.cli import common

    class Term(io.StringIO):
        def isatty(self):
            return True

    now = [100.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert common._progress("m") is None  # not a terminal: no line at all
    term = Term()
    monkeypatch.setattr(sys, "stderr", term)
    show = common._progress("m")
    show(1, 5, "packing wqkv")
    now[0] += 0.9
    show(2, 5, "packing wo")
    assert term.getvalue() == ""  # a load under a second prints nothing
    now[0] += 0.2
    show(3, 5, "packing w13")
    show(5, 5, "packing output")
    out = term.getvalue()
    assert "loading m: 3/5 packing w13" in out and "5/5 packing output" in out and out.endswith("\n")


def test_f16_rows_for_fp16_are_the_round_trip():
    """fp16 panels of an F16 tensor take its bits where no row has a NaN: the same as widening to
    float32 and rounding back, on every non-NaN pattern; rows with a NaN take the round trip."""
    from tinydet.numerics.simd import to_f16_bits
    from tinydet.packing.weights import _pack_float, storage
    from tinydet.formats import Tensor
    from tinydet.formats.ggml import F16

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    nan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)
    back = to_f16_bits(bits.view(np.float16).astype(np.float32))
    assert np.array_equal(back[~nan], bits[~nan])
    rng = np.random.default_rng(0)
    for with_nan in (False, True):
        w = rng.choice(bits[~nan], (100, 96)).astype(np.uint16)
        if with_nan:
            w[70, 5] = 0x7E01
        order = rng.permutation(100)
        w2 = rng.choice(bits[~nan], (37, 96)).astype(np.uint16)
        for ro in (None, order):
            t = Tensor(w.reshape(-1).view(np.uint8), F16, (100, 96), ro)
            t2 = Tensor(w2.reshape(-1).view(np.uint8), F16, (37, 96))  # its rows straddle panels
            want = storage(np.concatenate([t.float32(), t2.float32()]), "fp16")
            got = _pack_float([t, t2], "fp16")
            assert np.array_equal(got.transpose(0, 2, 1).reshape(-1, 96)[:137], want)
            assert not got.transpose(0, 2, 1).reshape(-1, 96)[137:].any()


def test_cli_no_panel_cache(model_file, tmp_path):
    from click.testing import CliRunner

    from tinydet.cli import main

    args = ["generate", "Once", "--model", str(model_file), "--dtype", "native", "--max-tokens", "1"]
    r = CliRunner().invoke(main, args + ["--no-panel-cache"])
    assert r.exit_code == 0, r.output
    assert cache_files(tmp_path) == []
    r = CliRunner().invoke(main, args)  # the flag does not stick to later invocations
    assert r.exit_code == 0, r.output
    assert len(cache_files(tmp_path)) == 1


def test_old_temporary_files_are_swept(model_file, tmp_path):
    import time

    folder = tmp_path / "cache" / "panels"
    folder.mkdir(parents=True)
    old, new = folder / "x.tdp.abc.tmp", folder / "y.tdp.def.tmp"
    for p in (old, new):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    tinydet.load(model_file, dtype="native")
    assert len(cache_files(tmp_path)) == 1 and not old.exists() and new.exists()


def test_other_attributes_round_trip_or_skip_the_cache(model_file, tmp_path, monkeypatch):
    """The cache is generic over what a CPUWeights holds: scalars and tuples of arrays come back as
    they were; an object it cannot describe leaves the load uncached, not failed."""
    from tinydet.packing import weights as W

    key, path, w = _build(model_file)
    w.extra = (w.norm, 3, "x", None, [1.5])
    path.unlink()
    panelcache.write(path, key, w)
    back = w.restore(panelcache.read(path, key))
    assert back.extra[1:] == (3, "x", None, [1.5]) and np.array_equal(back.extra[0], w.norm)
    for p in cache_files(tmp_path):
        p.unlink()
    real = W.CPUWeights.__init__

    def with_object(self, *a, **k):
        real(self, *a, **k)
        self.odd = object()
    monkeypatch.setattr(W.CPUWeights, "__init__", with_object)
    m = tinydet.load(model_file, dtype="native")
    assert m.backend.weights.odd is not None and cache_files(tmp_path) == []
