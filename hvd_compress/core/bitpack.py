"""Bit packing of small integer codes and the byte layout of every payload.

Code stream
-----------
``n`` codes of ``b`` bits each (1 <= b <= 8) form a little-endian bit stream:
code ``i`` occupies stream bits ``[i*b, (i+1)*b)``, its least significant bit
first, and stream bit ``j`` is bit ``j % 8`` (LSB = 0) of byte ``j // 8``.
The last byte is zero-padded, so the stream takes exactly ``ceil(n*b/8)``
bytes.  When ``b`` divides 8 this means byte ``q`` holds codes
``q*(8/b) ... q*(8/b) + 8/b - 1``, the first in the low bits.

Payload bytes
-------------
A payload that travels by allgather is one flat ``uint8`` buffer made of
segments laid end to end, in the order each compressor lists them, with no
header (every segment's length follows from the tensor's shape and the
compressor's parameters, which all ranks know).  Floats are IEEE-754 float32
and integers int32, both little-endian, as the hardware holds them.
"""

from __future__ import annotations

__all__ = ["packed_nbytes", "pack_codes", "unpack_codes", "Segment", "join_segments",
           "split_segments"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


# Packing b-bit codes (b = 1, 2, 4) without a loop: the 8/b codes of one output
# byte, one per input byte, are read as one little-endian integer x and
# multiplied by MAGIC; byte 7 (b=1), 3 (b=2) or 1 (b=4) of the product is then
# sum_i code_i << (i*b), and no partial sum carries into it.
_MAGIC = {1: (0x0102040810204080, 56, "int64"),
          2: (0x01041040, 24, "int32"),
          4: (0x0110, 8, "int16")}


def pack_codes(B, codes, bits: int):
    """Pack flat ``codes`` (integers in ``[0, 2**bits)``) into ``packed_nbytes`` uint8 bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    n = B.shape(codes)[0]
    codes = B.cast(codes, "uint8")
    if bits == 8:
        return codes
    if bits in _MAGIC:
        magic, shift, word = _MAGIC[bits]
        per = 8 // bits
        words = B.bitcast(B.pad_to(codes, -(-n // per) * per), word)
        packed = B.imul(B.cast(words, "int64"), magic)  # a fresh int64 array: in place
        return B.cast(B.iand(B.ishr(packed, shift), 0xFF), "uint8")
    # Other b: spread every code into its bits, then pack 8 bits a byte.
    shifts = B.arange(bits, "uint8", like=codes)
    bitmat = B.bit_and(B.shift_right(B.reshape(codes, (-1, 1)), shifts), 1)
    stream = B.pad_to(B.reshape(bitmat, (-1,)), packed_nbytes(n, bits) * 8)
    return pack_codes(B, stream, 1)


def code_table(bits: int):
    """``table[byte, j]``: the j-th code held in ``byte`` (b = 1, 2, 4, 8); a nested list."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return [[(byte >> (j * bits)) & mask for j in range(per)] for byte in range(256)]


def unpack_values(B, data, bits: int, n: int, values, factors=None, d=None):
    """Decode packed ``data`` straight to ``values[code]`` (float32) for ``n`` codes, times
    ``factors[i // d]`` for code ``i`` when ``factors`` are given (one per bucket of ``d``).

    ``values`` is a list of 2**bits floats, or a 1-d float32 array of that
    length; one table look-up per byte replaces unpacking and mapping.  A backend
    with a fused op for it (TensorFlow on CPU) does it all in one pass.
    """
    fused = B.fused_unpack(data, bits, n, values, factors, d)
    if fused is not None:
        return fused
    if bits not in (1, 2, 4, 8):
        codes = unpack_codes(B, data, bits, n)
        table = values if not isinstance(values, list) else B.asarray(values, "float32", like=data)
        out = B.lookup(table, codes)
    else:
        per = 8 // bits
        if isinstance(values, list):
            table = B.asarray([[values[c] for c in row] for row in code_table(bits)], "float32",
                              like=data)
        else:
            idx = B.asarray(code_table(bits), "int64", like=data)
            table = B.lookup(values, B.reshape(idx, (-1,)))
            table = B.reshape(table, (256, per))
        out = B.reshape(B.lookup(table, data), (-1,))[:n]
    return out if factors is None else B.bucket_scale(out, factors, d)


def unpack_codes(B, data, bits: int, n: int):
    """Inverse of :func:`pack_codes`: ``n`` uint8 codes from packed bytes ``data``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if bits == 8:
        return data[:n]
    if 8 % bits == 0:
        table = B.asarray(code_table(bits), "uint8", like=data)
        return B.reshape(B.lookup(table, data), (-1,))[:n]
    stream = unpack_codes(B, data, 1, n * bits)
    bitmat = B.reshape(stream, (n, bits))
    shifts = B.arange(bits, "uint8", like=data)
    return B.cast(B.sum(B.shift_left(bitmat, shifts), axis=1), "uint8")


class Segment:
    """One field of a byte payload: a name, a dtype and a count of elements."""

    ITEMSIZE = {"float32": 4, "int32": 4, "int64": 8, "uint8": 1, "float16": 2, "uint16": 2}

    def __init__(self, name: str, dtype: str, count: int):
        self.name, self.dtype, self.count = name, dtype, count

    @property
    def nbytes(self) -> int:
        return self.ITEMSIZE[self.dtype] * self.count

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.dtype}, {self.count})"


def join_segments(B, layout, arrays: dict):
    """Lay the arrays out as bytes in the order of ``layout`` (a list of Segments)."""
    parts = []
    for seg in layout:
        a = B.reshape(arrays[seg.name], (-1,))
        if B.shape(a)[0] != seg.count:
            raise ValueError(f"segment {seg.name}: expected {seg.count} elements, got {B.shape(a)[0]}")
        parts.append(B.bitcast(B.cast(a, seg.dtype), "uint8") if seg.dtype != "uint8" else a)
    return B.concat(parts)


def split_segments(B, layout, data) -> dict:
    """Inverse of :func:`join_segments`."""
    out, offset = {}, 0
    for seg in layout:
        chunk = data[offset:offset + seg.nbytes]
        out[seg.name] = chunk if seg.dtype == "uint8" else B.bitcast(chunk, seg.dtype)
        offset += seg.nbytes
    if offset != B.shape(data)[0]:
        raise ValueError(f"payload has {B.shape(data)[0]} bytes, layout expects {offset}")
    return out
