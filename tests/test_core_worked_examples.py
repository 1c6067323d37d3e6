"""Small hand-computed inputs whose payload bytes are asserted exactly."""

import struct

import numpy as np
import pytest

from hvd_compress.core import NUMPY, build
from hvd_compress.core.bitpack import pack_codes, packed_nbytes, unpack_codes


def f32(*values) -> bytes:
    return struct.pack("<" + "f" * len(values), *values)


def i32(*values) -> bytes:
    return struct.pack("<" + "i" * len(values), *values)


def test_onebit_payload_bytes():
    x = np.array([0.5, -1.0, 2.0, -3.0, 0.0, 1.5, -0.5, 4.0, 1.0], np.float32)
    comp = build("onebit")
    enc = comp.encode(x, "w")
    # pos = mean(0.5, 2, 0, 1.5, 4, 1) = 1.5; neg = mean(-1, -3, -0.5) = -1.5;
    # sign bits 1,0,1,0,1,1,0,1 | 1 -> 0b10110101 = 0xB5, 0x01
    assert enc.payload.tobytes() == f32(1.5) + f32(-1.5) + bytes([0xB5, 0x01])
    assert enc.nbytes == 10
    np.testing.assert_array_equal(comp.decode(enc.payload, enc.meta),
                                  [1.5, -1.5, 1.5, -1.5, 1.5, 1.5, -1.5, 1.5, 1.5])
    # error feedback keeps the rest
    np.testing.assert_allclose(comp.states["w"]["residual"],
                               x - comp.decode(enc.payload, enc.meta))


def test_onebit_is_column_wise_for_matrices():
    x = np.array([[1.0, -2.0], [3.0, -4.0], [-1.0, 6.0]], np.float32)  # 2 columns
    enc = build("onebit").encode(x, "m")
    # column 0: pos mean(1, 3) = 2, neg -1; column 1: pos 6, neg mean(-2, -4) = -3
    # signs row-major: 1,0,1,0,0,1 -> 0b100101 = 0x25
    assert enc.payload.tobytes() == f32(2.0, 6.0) + f32(-1.0, -3.0) + bytes([0x25])


def test_threshold_payload_bytes():
    x = np.array([1.5, -2.0, 0.5, -0.5, 1.0, -1.0], np.float32)
    comp = build("threshold:tau=1")
    enc = comp.encode(x, "w")
    # codes 1,2,0,0,1,2 -> byte0 = 1 | 2<<2 = 9, byte1 = 1 | 2<<2 = 9
    assert enc.payload.tobytes() == f32(1.0) + bytes([0x09, 0x09])
    np.testing.assert_array_equal(comp.states["w"]["residual"], [0.5, -1.0, 0.5, -0.5, 0.0, 0.0])


def test_terngrad_payload_bytes():
    x = np.array([0.5, -1.0, 0.25, 0.0], np.float32)
    comp = build("terngrad:clip=0")
    enc = comp.encode(x, "w", noise=np.array([0.4, 0.9, 0.3, 0.1], np.float32))
    # scale 1; keep where u < |x|/scale: T, T, F, F -> codes 1, 2, 0, 0 -> 0x09
    assert enc.payload.tobytes() == f32(1.0) + bytes([0x09])
    np.testing.assert_array_equal(comp.decode(enc.payload, enc.meta), [1.0, -1.0, 0.0, 0.0])


def test_qsgd_payload_bytes():
    x = np.array([3.0, -4.0, 0.0, 0.0], np.float32)
    comp = build("qsgd:levels=2,bucket=4")  # 5 codes -> 3 bits
    enc = comp.encode(x, "w", noise=np.array([0.5, 0.3, 0.2, 0.9], np.float32))
    # norm 5; s*|x|/norm = 1.2, 1.6, 0, 0; + noise, floor -> 1, 1, 0, 0
    # codes s + sign*level = 3, 1, 2, 2; 3-bit stream 110 100 010 010 -> 0x8B, 0x04
    assert enc.payload.tobytes() == f32(5.0) + bytes([0x8B, 0x04])
    np.testing.assert_array_equal(comp.decode(enc.payload, enc.meta), [2.5, -2.5, 0.0, 0.0])


def test_topk_payload_bytes():
    x = np.array([0.1, -0.5, 0.3, 0.2], np.float32)
    comp = build("topk:ratio=0.5")
    enc = comp.encode(x, "w")
    assert enc.payload.tobytes() == i32(1, 2) + f32(-0.5, 0.3)
    np.testing.assert_array_equal(comp.states["w"]["residual"], np.array([0.1, 0, 0, 0.2], np.float32))


def test_topk_ties_go_to_the_lower_index():
    enc = build("topk:ratio=0.5,ef=false").encode(np.array([1.0, -1.0, 1.0, 1.0], np.float32))
    assert enc.payload.tobytes() == i32(0, 1) + f32(1.0, -1.0)


def test_bf16_rounds_to_nearest_even():
    comp = build("bf16")
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even -> 1.0
    # 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even -> 1 + 2^-6
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.0, np.nan], np.float32)
    bits = comp.encode(x).payload
    assert bits.dtype == np.uint16
    assert [hex(b) for b in bits[:3]] == ["0x3f80", "0x3f82", "0xc000"]
    assert np.isnan(comp.decode(bits, comp.meta_for(x))[3])


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_layout_matches_little_endian_stream(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, size=29).astype(np.uint8)
    packed = pack_codes(NUMPY, codes, bits)
    assert packed.shape == (packed_nbytes(29, bits),)
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).ravel()
    np.testing.assert_array_equal(packed, np.packbits(stream, bitorder="little"))
    np.testing.assert_array_equal(unpack_codes(NUMPY, packed, bits, 29), codes)
