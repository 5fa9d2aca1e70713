"""The GGUF reader: every value type, validation before any data is touched, clear errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tinydet.errors import ModelFormatError
from tinydet.formats.gguf import GGUFFile

import ggufgen as G


def write(tmp_path, data: bytes, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def f32_tensor(name, shape, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape).astype("<f4")
    return (name, shape, 0, a.tobytes()), a


def test_every_metadata_type_and_nested_arrays(tmp_path):
    meta = {
        "u8": G.typed(G.UINT8, 250), "i8": G.typed(G.INT8, -5), "u16": G.typed(G.UINT16, 65000),
        "i16": G.typed(G.INT16, -300), "u32": G.typed(G.UINT32, 4_000_000_000), "i32": G.typed(G.INT32, -7),
        "f32": G.typed(G.FLOAT32, 1.5), "bool": True, "str": "héllo ✓", "u64": G.typed(G.UINT64, 2**63 + 5),
        "i64": G.typed(G.INT64, -(2**40)), "f64": G.typed(G.FLOAT64, 0.1),
        "arr_f32": np.array([1.0, -2.5], np.float32), "arr_str": ["a", "", "ü"],
        "nested": G.typed(G.ARRAY, (G.ARRAY, [G.typed(G.ARRAY, (G.INT32, [1, 2])), G.typed(G.ARRAY, (G.INT32, [3]))])),
        "general.alignment": G.typed(G.UINT32, 64),
    }
    t, a = f32_tensor("w", (3, 4))
    p = write(tmp_path, G.build(meta, [t], alignment=64))
    g = GGUFFile(p)
    m = g.metadata
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (250, -5, 65000, -300, 4_000_000_000, -7)
    assert m["f32"] == 1.5 and m["bool"] is True and m["str"] == "héllo ✓"
    assert m["u64"] == 2**63 + 5 and m["i64"] == -(2**40) and m["f64"] == 0.1
    assert m["arr_f32"].tolist() == [1.0, -2.5] and m["arr_str"] == ["a", "", "ü"]
    assert [x.tolist() for x in m["nested"]] == [[1, 2], [3]]
    assert g.alignment == 64 and g.data_offset % 64 == 0
    assert np.array_equal(g.tensor_view("w"), a)
    assert g.tensor_view("w").base is not None  # a view of the map, not a copy


def test_reader_agrees_with_gguf_package(stories_path, smollm_path):
    gguf = pytest.importorskip("gguf")
    for path in (stories_path, smollm_path):
        ours = GGUFFile(path)
        theirs = gguf.GGUFReader(path)
        assert set(ours.tensors) == {t.name for t in theirs.tensors}
        for t in theirs.tensors:
            o = ours.tensors[t.name]
            assert o.offset == t.data_offset and o.nbytes == t.n_bytes and o.ggml_type == int(t.tensor_type)
            assert list(o.shape) == [int(d) for d in reversed(t.shape)]
        for name, field in theirs.fields.items():
            if name.startswith("GGUF."):
                continue
            v = ours.metadata[name]
            if isinstance(v, list):
                assert v == field.contents()
            elif isinstance(v, np.ndarray):
                assert v.tolist() == field.contents()
            else:
                assert v == pytest.approx(field.contents())


@pytest.mark.parametrize("version", [2, 3])
def test_versions_2_and_3(tmp_path, version):
    t, a = f32_tensor("w", (2, 8))
    g = GGUFFile(write(tmp_path, G.build({"k": "v"}, [t], version=version)))
    assert g.version == version and np.array_equal(g.tensor_view("w"), a)


def expect_error(path, field_part, msg_part):
    with pytest.raises(ModelFormatError) as ei:
        GGUFFile(path)
    s = str(ei.value)
    assert str(path) in s and field_part in s and msg_part in s, s
    assert "\n" not in s


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "path", "no such file")


def test_open_checkpoint_takes_a_path_only(tmp_path, monkeypatch):
    """Names are the registry's (api.load resolves them first): a name is a missing path here, and
    nothing is pulled."""
    from tinydet.formats import open_checkpoint

    monkeypatch.chdir(tmp_path)
    for missing in (tmp_path / "nope.gguf", "stories260k"):
        with pytest.raises(ModelFormatError, match="path: no such file or directory") as ei:
            open_checkpoint(missing)
        assert str(missing) in str(ei.value) and "\n" not in str(ei.value)


def test_not_gguf(tmp_path):
    expect_error(write(tmp_path, b"PK\x03\x04" + b"x" * 100), "magic", "not a GGUF file")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(tmp_path, version):
    t, _ = f32_tensor("w", (2, 8))
    expect_error(write(tmp_path, G.build({}, [t], version=version)), "version", "expected 2 or 3")


def test_truncated(tmp_path, stories_path):
    data = stories_path.read_bytes()
    for cut in (10, 30, 2000, 20000):
        expect_error(write(tmp_path, data[:cut], f"cut{cut}.gguf"), "", "")
    # Cut inside the tensor data: the header parses, the last tensor runs past the end.
    expect_error(write(tmp_path, data[:-100], "tail.gguf"), ".offset", "runs past the end of the file")


def test_truncated_header_says_truncated(tmp_path, stories_path):
    expect_error(write(tmp_path, stories_path.read_bytes()[:3000]), "", "truncated")


def test_tensor_past_end(tmp_path):
    t, _ = f32_tensor("w", (4, 8))
    data = bytearray(G.build({}, [t]))
    # Point the tensor's offset far beyond the file: the u64 offset follows name, n_dims, dims, type.
    hdr = 4 + 4 + 8 + 8
    off_pos = hdr + 8 + 1 + 4 + 8 * 2 + 4
    data[off_pos:off_pos + 8] = struct.pack("<Q", 1 << 20)
    expect_error(write(tmp_path, bytes(data)), "w.offset", "runs past the end of the file")


def test_tensor_size_past_end(tmp_path):
    name, shape, gtype, raw = f32_tensor("w", (4, 8))[0]
    data = G.build({}, [(name, (4000, 8), gtype, raw)])
    expect_error(write(tmp_path, data), "w.offset", "runs past the end of the file")


@pytest.mark.parametrize("gtype", [10, 99])  # Q2_K (not supported yet), and no such type
def test_unknown_tensor_type(tmp_path, gtype):
    data = G.build({}, [("w", (2, 256), gtype, b"\0" * 1024)])
    expect_error(write(tmp_path, data), "w.type", "unsupported tensor type")


def test_misaligned_offset_and_bad_counts(tmp_path):
    data = bytearray(G.build({}, [f32_tensor("w", (2, 8))[0]]))
    data[8:16] = struct.pack("<Q", 10**12)  # tensor count
    expect_error(write(tmp_path, bytes(data), "count.gguf"), "header", "cannot fit")


def test_duplicate_key(tmp_path):
    data = bytearray(G.build({"a": 1, "b": 2}, []))
    i = data.index(b"b", 24)
    data[i] = ord("a")
    expect_error(write(tmp_path, bytes(data)), "a", "duplicate metadata key")


def test_release_keeps_bytes_readable(stories_path):
    """Dropping a tensor's pages after use is advice only: its bytes read back the same."""
    from tinydet.formats.gguf import GGUFFile

    g = GGUFFile(stories_path)
    name = "blk.0.ffn_up.weight"
    before = g.tensor_bytes(name).copy()
    g.release(name)
    assert np.array_equal(g.tensor_bytes(name), before)
    g.release(name, 0, 100)  # part of it
    assert np.array_equal(g.tensor_bytes(name), before)


def test_drop_metadata_forgets_those_keys_and_keeps_the_rest_readable(stories_path):
    """What the tokenizer has read goes before the weights load: those keys, and the header's pages
    (advice only: a numeric array still viewing the map, and every tensor, read back the same)."""
    g = GGUFFile(stories_path)
    scores = g.metadata["tokenizer.ggml.scores"]
    before = scores.copy()
    name = "blk.0.ffn_up.weight"
    tensor = g.tensor_bytes(name).copy()
    dropped = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    kept = [k for k in g.metadata if not k.startswith(dropped)]
    assert len(kept) == len(g.metadata) - 2
    g.drop_metadata(dropped)
    assert list(g.metadata) == kept
    assert np.array_equal(scores, before) and np.array_equal(g.tensor_bytes(name), tensor)
