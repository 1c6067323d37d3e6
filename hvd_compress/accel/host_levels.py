"""Host fast paths of the level codecs: natural compression, max-min uniform levels,
8-bit's and SketchML's table codes (kernels: :mod:`.kernels_levels`).

The scales, levels and SketchML's edges come from the codec's own helpers (the
reference arithmetic); the kernels do the codes, the packing and, with error
feedback, the residual update, with the chain's bits.  Table codes are each value's
rank among the sorted edges, counted on from :func:`start_table`.
"""

from __future__ import annotations

import numpy as np

from ..core.bitpack import pack_codes
from ..core.levels import EightBitCodec, NaturalCodec, SketchMLCodec, UniformCodec
from .host import code_buffer, ef_encoder, register


def _natural(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    exps, signs = np.empty(n, np.uint8), code_buffer(n, 1)
    k.natural_codes(B.host_view(v), B.host_view(noise), codec.powers, exps, signs, ef)
    return {"exps": B.from_host(exps), "signs": B.from_host(signs)}


def _uniform(k, B, codec, v, noise, ef):
    n, bits, d = B.shape(v)[0], codec.bits, codec.d
    vh = B.host_view(v)
    lo, hi = (B.from_host(t) for t in k.bucket_minmax(vh, d))
    scale, inv = codec.scales(B, lo, hi)
    pack = bits if 8 % bits == 0 else 8  # other widths: one code a byte, packed after
    out = code_buffer(n, pack)
    u = B.host_view(noise) if codec.needs_noise else np.empty(0, np.float32)
    k.uniform_codes(vh, B.host_view(inv), B.host_view(lo * inv), u, np.float32(codec.levels), d,
                    codec.needs_noise, pack, out, B.host_view(lo), B.host_view(scale), ef)
    codes = B.from_host(out)
    return {"mins": lo, "scales": scale, "codes": codes if pack == bits else pack_codes(B, codes, bits)}


def start_table(edges, scale=1.0):
    """For each 16-bit prefix of a float32 ``x`` (its sign, exponent and 7 mantissa bits):
    how many of the sorted ``edges`` are <= the smallest ``x * scale`` with that prefix,
    a count the kernels go on from (one or two comparisons instead of a binary search;
    exact, as the smallest value of a prefix bounds every value of it)."""
    prefix = np.arange(65536, dtype=np.uint32) << 16
    first = prefix.view(np.float32)  # the prefix's value with the other bits 0
    last = (prefix | 0xFFFF).view(np.float32)  # ... and 1: the most negative of a negative one
    with np.errstate(invalid="ignore", over="ignore"):
        low = np.where((prefix >> 31) == 1, last, first) * np.float32(scale)
        table = np.searchsorted(edges, low, side="right")
    table[np.isnan(low)] = 0
    return table.astype(np.int32)


def _eightbit(k, B, codec, v, noise, ef):
    s = codec.scale(B, v)
    inv = np.float32(B.to_numpy(codec.inverse(B, s)))
    out = np.empty(B.shape(v)[0], np.uint8)
    k.eightbit_codes(B.host_view(v), inv, codec.edges, start_table(codec.edges, inv),
                     codec.levels, np.float32(B.to_numpy(s)), out, ef)
    return {"scale": B.reshape(B.cast(s, "float32"), (1,)), "codes": B.from_host(out)}


_CHUNKS = 64  # SketchML's sums: fixed stretches, so the bits do not depend on the threads


def _sketchml(k, B, codec, v, noise, ef):
    vh = B.host_view(v)
    codes = np.empty(B.shape(v)[0], codec.code_dtype)
    edges = np.ascontiguousarray(B.host_view(codec.edges(B, v)))  # the chain's: a sorted sample
    sums, counts = k.bucket_codes(vh, edges, start_table(edges), codes, codec.q, _CHUNKS)
    means = codec.means(B, B.from_host(sums), B.from_host(counts))
    if ef:
        k.lookup_subtract(vh, codes, B.host_view(means))
    return {"means": means, "codes": B.from_host(codes)}


def _natural_decode(k, B, codec, f, out):
    k.natural_decode(f["exps"], f["signs"], codec.powers.view(np.int32), out.view(np.int32))


def _uniform_decode(k, B, codec, f, out):
    k.bucket_decode(f["codes"], codec.bits, codec.d, 0, f["scales"], f["mins"], out)


def _eightbit_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], codec.levels, np.float32(f["scale"][0]), out)


def _sketchml_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], f["means"], np.float32(1.0), out)


register(NaturalCodec, encoder=ef_encoder(_natural), decoder=_natural_decode)
register(UniformCodec, encoder=ef_encoder(_uniform), decoder=_uniform_decode,
         decodes=lambda codec, cols: 8 % codec.bits == 0)  # other widths: the chain
register(EightBitCodec, encoder=ef_encoder(_eightbit), decoder=_eightbit_decode)
register(SketchMLCodec, encoder=ef_encoder(_sketchml), decoder=_sketchml_decode)
