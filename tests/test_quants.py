"""tinydet.formats.dequant.dequantize: bit-exact against gguf-py, hand-derived blocks, input validation, real models."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tinydet.formats.ggml import GGML_TYPE_IDS, GGML_TYPES
from tinydet.formats.gguf import GGUFFile
from tinydet.formats.dequant import SUPPORTED_TYPES, dequantize

ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h).
SCALE_OFFSETS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
# Byte ranges of the 6-bit (Q4_K/Q5_K) or int8 (Q6_K) sub-block scales.
SUBSCALE_RANGES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208)}

# fp16 bit patterns: +-0, subnormals (min, max, negative), min normal, 1, -1, max, +-inf, quiet NaN,
# signalling NaN, NaN with sign and payload, and an ordinary negative scale.
SPECIAL_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
               0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE5A, 0xB1A3]

BLOCKS = 256  # blocks per random tensor: 16 rows x 16 blocks


def bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    gb, wb = bits(got), bits(want)
    if not np.array_equal(gb, wb):
        i = np.flatnonzero(gb.ravel() != wb.ravel())
        raise AssertionError(f"{i.size} of {gb.size} elements differ, first at flat index {i[0]}: "
                             f"got 0x{gb.ravel()[i[0]]:08x}, want 0x{wb.ravel()[i[0]]:08x}")


def reference(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        import gguf.quants as gq
        from gguf.constants import GGMLQuantizationType
    except ImportError as e:
        pytest.skip(f"the gguf package (the reference dequantizer) is not importable: {e}")

    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    rows = raw.reshape(-1, shape[-1] // t.block_size * t.type_size)
    with np.errstate(all="ignore"):
        return np.ascontiguousarray(gq.dequantize(rows, GGMLQuantizationType(GGML_TYPE_IDS[name]))).reshape(shape)


def random_tensor(name: str, seed: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Random bytes for a 16-row tensor, with every fp16 scale special value (all pairs of them where a
    block has two scales) and, for the K-quants, every byte value at every sub-scale position."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    if t.block_size == 1:
        if name == "F32":
            vals = rng.integers(0, 1 << 32, 4096, dtype=np.uint32)
            specials = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
                        0x7FC00000, 0x7F800001, 0xFFC12345, 0x7F7FFFFF, 0x3F800000]
            vals[:len(specials)] = specials
            return vals.view(np.uint8), (16, 256)
        # F16 / BF16: every one of the 65536 bit patterns, shuffled.
        vals = rng.permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
        return vals.view(np.uint8), (256, 256)
    raw = rng.integers(0, 256, (BLOCKS, t.type_size), dtype=np.uint8)
    if name == "MXFP4":  # every E8M0 exponent 0..255 once (subnormal scales, overflow to inf), random codes
        raw[:, 0] = rng.permutation(256).astype(np.uint8)
        return raw.reshape(-1), (16, 16 * t.block_size)
    offs = SCALE_OFFSETS[name]
    sp = np.array(SPECIAL_F16, dtype=np.uint16)
    i = np.arange(BLOCKS)
    first = sp[i % len(sp)]
    raw[:, offs[0]:offs[0] + 2] = first.view(np.uint8).reshape(-1, 2)
    if len(offs) == 2:
        second = sp[(i // len(sp)) % len(sp)]
        raw[:, offs[1]:offs[1] + 2] = second.view(np.uint8).reshape(-1, 2)
    if name in SUBSCALE_RANGES:
        lo, hi = SUBSCALE_RANGES[name]
        k = np.arange(hi - lo)
        raw[:, lo:hi] = ((i[:, None] + 37 * k[None, :]) % 256).astype(np.uint8)
    return raw.reshape(-1), (16, 16 * t.block_size)


# --- 1. bit-exact against gguf-py on random blocks with special scales ----------------------------------

@pytest.mark.parametrize("name", ALL_TYPES)
def test_random_blocks_match_gguf_bitwise(name):
    for seed in (0, 1, 2):
        raw, shape = random_tensor(name, seed)
        want = reference(raw, name, shape)
        got = dequantize(raw, GGML_TYPE_IDS[name], shape)
        assert got.flags.c_contiguous and got.flags.writeable and not np.shares_memory(got, raw)
        assert_same_bits(got, want)


def test_random_blocks_really_cover_special_values():
    """The random tensors above do contain the edge cases they claim to (NaN, inf, -0.0 results)."""
    for name in ["Q4_1", "Q5_K", "Q6_K", "Q8_0"]:
        raw, shape = random_tensor(name, 0)
        got = dequantize(raw, GGML_TYPE_IDS[name], shape)
        assert np.isnan(got).any() and np.isinf(got).any()
        assert (bits(got) == 0x80000000).any()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_unaligned_readonly_memmap_input(name, tmp_path):
    """raw as a read-only memmap slice at an odd file offset, with a leading (rows, bytes) shape."""
    raw, shape = random_tensor(name, 3)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x07" + raw.tobytes() + b"\x09")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[1:1 + raw.size].reshape(shape[0], -1)
    assert not view.flags.writeable
    got = dequantize(view, GGML_TYPE_IDS[name], shape)
    assert not np.shares_memory(got, mm)
    assert_same_bits(got, dequantize(raw, GGML_TYPE_IDS[name], shape))
    assert_same_bits(got, reference(raw, name, shape))
    del view, mm


# --- 2. one hand-derived block per type ------------------------------------------------------------------

def h(x: int) -> bytes:
    """An fp16/bf16 bit pattern as 2 little-endian bytes."""
    return struct.pack("<H", x)


HAND = {
    # F32: 1.5 = 0x3FC00000, -2.0 = 0xC0000000, -0.0, smallest subnormal 2**-149.
    "F32": (struct.pack("<4I", 0x3FC00000, 0xC0000000, 0x80000000, 0x00000001),
            [1.5, -2.0, -0.0, 1.401298464324817e-45]),
    # F16: 1.0, -2.0, 0x3555 = 2**-2 * (1 + 341/1024) = 0.333251953125, 2**-24 (subnormal), +inf, -0.0.
    "F16": (h(0x3C00) + h(0xC000) + h(0x3555) + h(0x0001) + h(0x7C00) + h(0x8000),
            [1.0, -2.0, 0.333251953125, 5.960464477539063e-08, float("inf"), -0.0]),
    # BF16: top half of float32: 0x3F80 = 1.0, 0xC040 = -3.0, 0x4049 = 3.140625, 0x0001 = 2**-133.
    "BF16": (h(0x3F80) + h(0xC040) + h(0x4049) + h(0x0001),
             [1.0, -3.0, 3.140625, 9.183549615799121e-41]),
    # Q8_0: d = 0.125 (0x3000), qs int8; y = q * d.
    "Q8_0": (h(0x3000) + struct.pack("<32b", -128, -127, -64, -1, 0, 1, 64, 127, *range(-12, 12)),
             [-16.0, -15.875, -8.0, -0.125, 0.0, 0.125, 8.0, 15.875,
              -1.5, -1.375, -1.25, -1.125, -1.0, -0.875, -0.75, -0.625, -0.5, -0.375, -0.25, -0.125,
              0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25, 1.375]),
    # Q4_0: d = 0.5 (0x3800); qs[j] = j | (15 - j) << 4, so y[j] = 0.5 * (j - 8), y[16 + j] = 0.5 * (7 - j).
    "Q4_0": (h(0x3800) + bytes(j | (15 - j) << 4 for j in range(16)),
             [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
              3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, -4.0]),
    # Q4_1, two blocks. Block 1: d = 0.25 (0x3400), m = -1.0 (0xBC00), nibbles as Q4_0: y = 0.25 q - 1.
    # Block 2: d = 2**-14 (0x0400), m = 1024 (0x6400), qs[j] = j | j << 4. 1024 + q * 2**-14 is rounded to
    # float32, whose spacing at 1024 is 2**-13: odd q land on a tie, broken to the even neighbour
    # (q = 1 -> 1024, 3 -> +2 ulp, 5 -> +2, 7 -> +4, ...): round-to-nearest-even of the exact sum.
    "Q4_1": (h(0x3400) + h(0xBC00) + bytes(j | (15 - j) << 4 for j in range(16))
             + h(0x0400) + h(0x6400) + bytes(j | j << 4 for j in range(16)),
             [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75,
              2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25, 0.0, -0.25, -0.5, -0.75, -1.0]
             + [1024.0, 1024.0, 1024.0001220703125, 1024.000244140625, 1024.000244140625,
                1024.000244140625, 1024.0003662109375, 1024.00048828125, 1024.00048828125,
                1024.00048828125, 1024.0006103515625, 1024.000732421875, 1024.000732421875,
                1024.000732421875, 1024.0008544921875, 1024.0009765625] * 2),
    # Q5_0: d = -0.5 (0xB800); qh = bytes 01 80 FF 00 (LE uint32 0x00FF8001): 5th bit set for elements
    # 0, 15 and 16..23; nibbles as Q4_0. q = element - 16: [0, -15..-2, 15, 15..8, -9..-16]; y = -0.5 q,
    # so q = 0 gives -0.0.
    "Q5_0": (h(0xB800) + bytes([0x01, 0x80, 0xFF, 0x00]) + bytes(j | (15 - j) << 4 for j in range(16)),
             [-0.0, 7.5, 7.0, 6.5, 6.0, 5.5, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, -7.5,
              -7.5, -7.0, -6.5, -6.0, -5.5, -5.0, -4.5, -4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0]),
    # Q5_1: d = 0.5 (0x3800), m = 2.0 (0x4000); qh and nibbles as Q5_0. q = [16, 1..14, 31, 31..24, 7..0];
    # y = 0.5 q + 2.
    "Q5_1": (h(0x3800) + h(0x4000) + bytes([0x01, 0x80, 0xFF, 0x00]) + bytes(j | (15 - j) << 4 for j in range(16)),
             [10.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5, 9.0, 17.5,
              17.5, 17.0, 16.5, 16.0, 15.5, 15.0, 14.5, 14.0, 5.5, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0]),
}

# Q4_K / Q5_K: d = 1.0 (0x3C00), dmin = 0.5 (0x3800); sub-block scales sc = [1, 63, 0, 10, 33, 17, 48, 2]
# and mins m = [0, 5, 63, 1, 20, 40, 3, 16], packed into 12 bytes as
#   bytes 0-3:  sc[j] | (sc[j+4] >> 4) << 6  -> 81 7F C0 0A
#   bytes 4-7:  m[j]  | (m[j+4]  >> 4) << 6  -> 40 85 3F 41
#   bytes 8-11: (sc[j+4] & 15) | (m[j+4] & 15) << 4 -> 41 81 30 02
# Every element of sub-block i has the 4-bit quant lo[i] = [0, 15, 7, 1, 2, 3, 9, 4]: qs byte chunk c
# (32 bytes) = lo[2c] | lo[2c+1] << 4 = F0, 17, 32, 49. y = (1.0 * sc) * q - 0.5 * m.
K_HEAD = h(0x3C00) + h(0x3800) + bytes([0x81, 0x7F, 0xC0, 0x0A, 0x40, 0x85, 0x3F, 0x41, 0x41, 0x81, 0x30, 0x02])
K_QS = bytes([0xF0] * 32 + [0x17] * 32 + [0x32] * 32 + [0x49] * 32)
# Q4_K: [1*0 - 0, 63*15 - 2.5, 0*7 - 31.5, 10*1 - 0.5, 33*2 - 10, 17*3 - 20, 48*9 - 1.5, 2*4 - 8]
HAND["Q4_K"] = (K_HEAD + K_QS, np.repeat([0.0, 942.5, -31.5, 9.5, 56.0, 31.0, 430.5, 0.0], 32).tolist())
# Q5_K: qh[l] = 0xA6 = 0b10100110 for every l adds 16 to sub-blocks 1, 2, 5, 7: q = [0, 31, 23, 1, 2, 19, 9, 20]
# -> [0 - 0, 63*31 - 2.5, 0*23 - 31.5, 10 - 0.5, 66 - 10, 17*19 - 20, 48*9 - 1.5, 2*20 - 8]
HAND["Q5_K"] = (K_HEAD + bytes([0xA6] * 32) + K_QS,
                np.repeat([0.0, 1950.5, -31.5, 9.5, 56.0, 303.0, 430.5, 32.0], 32).tolist())
# Q6_K: d = 0.25 (0x3400); the 8 runs of 32 elements have 6-bit quants Q = [0, 63, 32, 31, 1, 48, 17, 40]:
#   ql[0:32] = 0|0<<4 = 00, ql[32:64] = 15|15<<4 = FF, qh[0:32] = 0 | 3<<2 | 2<<4 | 1<<6 = 6C,
#   ql[64:96] = 1|1<<4 = 11, ql[96:128] = 0|8<<4 = 80, qh[32:64] = 0 | 3<<2 | 1<<4 | 2<<6 = 9C.
# q - 32 = [-32, 31, 0, -1, -31, 16, -15, 8]; int8 scales, one per 16 elements:
#   [1, -1, 2, -2, 127, -128, 0, 3, 4, 5, 6, 7, 8, 9, 10, -10]; y = (0.25 * scale) * (q - 32), so
#   (0.25 * -128) * 0 = -0.0 and (0.25 * 0) * -1 = -0.0.
HAND["Q6_K"] = (bytes([0x00] * 32 + [0xFF] * 32 + [0x11] * 32 + [0x80] * 32 + [0x6C] * 32 + [0x9C] * 32)
                + struct.pack("<16b", 1, -1, 2, -2, 127, -128, 0, 3, 4, 5, 6, 7, 8, 9, 10, -10) + h(0x3400),
                np.repeat([-8.0, 8.0, 15.5, -15.5, 0.0, -0.0, -0.0, -0.75,
                           -31.0, -38.75, 24.0, 28.0, -30.0, -33.75, 20.0, -20.0], 16).tolist())


# MXFP4: block 1: e = 128 (d = 2^0 = 1), qs[j] = j | (15 - j) << 4: y[j] = kvalues[j], y[16 + j] =
# kvalues[15 - j] (kvalues: the E2M1 values doubled; code 8 is +0). Block 2: e = 0 (d = 2^-128, a float32
# subnormal), qs = 0x71 (codes 1 and 7): 2^-128 and 12 * 2^-128. Block 3: e = 255 (d = 2^127, no NaN),
# qs = 0xA1 (codes 1 and 10 = -2): 2^127 and -2^128, which overflows to -inf.
MX_KV = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0]
HAND["MXFP4"] = (bytes([128]) + bytes(j | (15 - j) << 4 for j in range(16)) + bytes([0]) + bytes([0x71] * 16)
                 + bytes([255]) + bytes([0xA1] * 16),
                 MX_KV + MX_KV[::-1] + [2.0 ** -128] * 16 + [12 * 2.0 ** -128] * 16
                 + [2.0 ** 127] * 16 + [float("-inf")] * 16)


def test_mxfp4_every_code_and_exponent():
    """Every (exponent, code) pair of MXFP4 against gguf-py and against kvalues * 2^(e - 128) computed in
    float64 (exact, then rounded once to float32: every value but the overflows is a float32)."""
    e = np.repeat(np.arange(256), 16).astype(np.uint8)  # block i: exponent i // 16
    codes = np.arange(16, dtype=np.uint8)
    raw = np.zeros((256 * 16, 17), np.uint8)
    raw[:, 0] = e
    raw[:, 1:] = (codes[None, :] | (codes[None, ::-1] << 4))  # low nibbles 0..15, high 15..0
    got = dequantize(raw, GGML_TYPE_IDS["MXFP4"], (raw.shape[0], 32))
    assert_same_bits(got, reference(raw, "MXFP4", (raw.shape[0], 32)))
    kv = np.array(MX_KV)
    want = np.ldexp(np.concatenate([kv, kv[::-1]])[None, :], e.astype(np.int64)[:, None] - 128)
    with np.errstate(over="ignore"):
        assert_same_bits(got, want.astype(np.float32))
    assert np.isinf(got).any() and (bits(got) == 0x00200000).any() and not (bits(got) == 0x80000000).any()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_hand_built_block(name):
    data, expected = HAND[name]
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    assert len(data) == len(expected) // t.block_size * t.type_size
    raw = np.frombuffer(data, dtype=np.uint8)
    got = dequantize(raw, GGML_TYPE_IDS[name], (len(expected),))
    assert_same_bits(got, np.array(expected, dtype=np.float32))


# --- 3. validation ---------------------------------------------------------------------------------------

def test_supported_types_are_the_expected_ones():
    assert sorted(SUPPORTED_TYPES.values()) == sorted(ALL_TYPES)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_wrong_byte_count_raises(name):
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    shape = (3, 2 * max(t.block_size, 16))
    need = 3 * shape[1] // t.block_size * t.type_size
    for n in (need - 1, need + 1, need - t.type_size, 0):
        with pytest.raises(ValueError, match=rf"{need}\b.*\b{n}\b"):
            dequantize(np.zeros(n, np.uint8), GGML_TYPE_IDS[name], shape)
    assert dequantize(np.zeros(need, np.uint8), GGML_TYPE_IDS[name], shape).shape == shape


@pytest.mark.parametrize("tid", [4, 5, 9, 10, 11, 15, 16, 20, 29, 31, 999, -1])
def test_unknown_type_raises(tid):
    with pytest.raises(ValueError, match=rf"unsupported ggml type id {tid}"):
        dequantize(np.zeros(64, np.uint8), tid, (16,))


def test_bad_row_length_and_raw_type():
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(np.zeros(34, np.uint8), GGML_TYPE_IDS["Q8_0"], (1, 16))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(np.zeros(144, np.uint8), GGML_TYPE_IDS["Q4_K"], ())
    with pytest.raises(TypeError, match="uint8"):
        dequantize(np.zeros(8, np.float32), GGML_TYPE_IDS["F32"], (8,))
    assert dequantize(np.zeros(0, np.uint8), GGML_TYPE_IDS["Q8_0"], (0, 32)).shape == (0, 32)


# --- 4. every tensor of the real models ------------------------------------------------------------------

def _check_model(path, allowed_types):
    f = GGUFFile(path)
    seen = set()
    for name, info in f.tensors.items():
        raw = f.tensor_bytes(name)
        got = dequantize(raw, info.ggml_type, info.shape)
        assert got.shape == info.shape
        assert_same_bits(got, reference(np.asarray(raw), info.type_name, info.shape))
        seen.add(info.type_name)
    assert seen == allowed_types


def test_stories260k_all_tensors_match_gguf(stories_path):
    _check_model(stories_path, {"F32"})


def test_smollm2_all_tensors_match_gguf(smollm_path):
    _check_model(smollm_path, {"F32", "Q8_0", "Q4_1"})


def test_gemma3_all_tensors_match_gguf(gemma3_path):
    """Gemma 3 270M Q4_K_M (F32, Q8_0, Q5_0, Q4_K, Q6_K, as llama.cpp quantizes a real model): every
    tensor, the 262144-row token table in slices of rows, dequantizes to gguf-py's bits."""
    f = GGUFFile(gemma3_path)
    seen = set()
    for name, info in f.tensors.items():
        raw = np.asarray(f.tensor_bytes(name))
        pieces = [(raw, info.shape)]
        if name == "token_embd.weight":
            n, k = info.shape
            rows = raw.reshape(n, -1)
            pieces = [(np.ascontiguousarray(rows[r0:r0 + 4096]), (4096, k)) for r0 in (0, n // 2 - 1000, n - 4096)]
        for piece, shape in pieces:
            assert_same_bits(dequantize(piece, info.ggml_type, shape), reference(piece, info.type_name, shape))
        seen.add(info.type_name)
    assert seen == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
