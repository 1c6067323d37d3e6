"""numba kernels of the level codecs: natural compression, max-min uniform levels (and
QSGD's bucket decode), 8-bit's and SketchML's table codes.

Codes, packing and, with error feedback, the residual update in one parallel pass with
the reference chain's float32 arithmetic (the chain's bits, ``tests/test_kernels.py``).
Table codecs count each value's rank among the sorted edges on from a 16-bit prefix
table (``host_levels.start_table``) instead of a binary search.  The wrappers are in
:mod:`.host_levels`.
"""

import numpy as np

from .jit import inline, parallel, prange


@parallel
def natural_codes(v, noise, table, exps, signs, subtract):
    """Natural compression: ``exps[i]`` the float32 exponent field of ``v[i]`` rounded
    up where ``noise[i] < mantissa / 2^23`` (at most 254), the sign bits (1: negative)
    packed 8 a byte; with ``subtract``, ``v -= +-table[exp]``."""
    n = v.shape[0]
    bits = v.view(np.int32)
    unit = np.float32(2.0 ** -23)
    unit_sign = np.asarray([1.0, -1.0], np.float32)
    for q in prange(signs.shape[0]):
        b = 0
        for j in range(8):
            i = q * 8 + j
            if i < n:
                w = bits[i]
                # no branches on the coin tosses (rounding up, the sign)
                e = min(((w >> 23) & 0xFF) + np.int32(noise[i] < np.float32(w & 0x7FFFFF) * unit),
                        254)
                exps[i] = e
                neg = (w >> 31) & 1
                b |= neg << j
                if subtract:
                    v[i] = v[i] - table[e] * unit_sign[neg]
        signs[q] = b

@parallel
def natural_decode(exps, signs, table, out):
    """``out[i] = +-table[exps[i]]``, the sign from bit i of ``signs`` (1: negative).
    ``table`` and ``out`` are int32 views of the float32 arrays: the sign is set as
    a bit (what multiplying by -1 does), except on NaN (code 255), which the
    multiplication leaves as it is."""
    n = out.shape[0]
    for q in prange(signs.shape[0]):
        b = np.int32(signs[q])
        for j in range(8):
            i = q * 8 + j
            if i < n:
                e = exps[i]
                neg = (b >> j) & 1 if e != 255 else 0
                out[i] = table[e] | (neg << 31)

@parallel
def bucket_minmax(v, d):
    """(min, max) of each bucket of ``d`` values (float32; ``v`` finite)."""
    n = v.shape[0]
    nb = (n + d - 1) // d
    lo = np.empty(nb, np.float32)
    hi = np.empty(nb, np.float32)
    for b in prange(nb):
        a = b * d
        mn = v[a]
        mx = v[a]
        for i in range(a + 1, min(n, a + d)):
            x = v[i]
            if x < mn:
                mn = x
            if x > mx:
                mx = x
        lo[b] = mn
        hi[b] = mx
    return lo, hi

@inline
def _groups(n, nbytes, per, d):
    """How the uniform kernels split their bytes: by bucket (``span`` bytes a group,
    the bucket known without a division) where buckets hold whole bytes and are
    many, else byte by byte; returns ``(groups, span, by_bucket)``."""
    nb = (n + d - 1) // d
    if d % per == 0 and nb >= 16:
        return nb, d // per, True
    return nbytes, 1, False

@parallel
def uniform_codes(v, inv, loinv, noise, levels, d, stochastic, bits, out, lo, scale, subtract):
    """Max-min codes ``min(floor(clip(v*inv - lo*inv, 0, L) + u), L)`` (``u`` the noise,
    or 0.5), packed ``8/bits`` a byte (``bits`` 1, 2, 4 or 8); with ``subtract``,
    ``v -= code * scale + lo`` per bucket."""
    n = v.shape[0]
    per = 8 // bits
    half = np.float32(0.5)
    zero = np.float32(0.0)
    groups, span, by_bucket = _groups(n, out.shape[0], per, d)
    for g in prange(groups):
        for q in range(g * span, min(out.shape[0], (g + 1) * span)):
            byte = 0
            for j in range(per):
                i = q * per + j
                if i < n:
                    k = np.int64(g) if by_bucket else i // d
                    x = v[i] * inv[k] - loinv[k]
                    x = min(max(x, zero), levels)
                    # floor of a non-negative value: its truncation (no libm call)
                    c = min(np.int32(x + (noise[i] if stochastic else half)), np.int32(levels))
                    byte |= c << (bits * j)
                    if subtract:
                        v[i] = v[i] - (np.float32(c) * scale[k] + lo[k])
            out[q] = byte

@parallel
def bucket_decode(codes, bits, d, offset, scale, lo, out):
    """``out[i] = (code_i - offset) * scale[bucket] (+ lo[bucket])`` in float32, per
    bucket of ``d``; codes packed ``8/bits`` a byte (``bits`` 1, 2, 4 or 8).
    Uniform's decode (offset 0, with ``lo``) and QSGD's (offset ``s``, ``lo``
    empty: nothing added, so a -0.0 stays -0.0 as in the chain)."""
    n = out.shape[0]
    per = 8 // bits
    mask = (1 << bits) - 1
    add = lo.shape[0] > 0
    groups, span, by_bucket = _groups(n, codes.shape[0], per, d)
    for g in prange(groups):
        for q in range(g * span, min(codes.shape[0], (g + 1) * span)):
            byte = np.int32(codes[q])
            for j in range(per):
                i = q * per + j
                if i < n:
                    k = np.int64(g) if by_bucket else i // d
                    x = np.float32(((byte >> (bits * j)) & mask) - offset) * scale[k]
                    out[i] = x + lo[k] if add else x

@inline
def _rank(edges, a, x):
    """How many of the sorted ``edges`` are <= ``x``, counting on from ``a`` (a count
    known not to exceed it: the start table's, see ``host_levels.start_table``)."""
    m = edges.shape[0]
    while a < m and edges[a] <= x:
        a += 1
    return a

@parallel
def eightbit_codes(v, inv, edges, start, table, scale, out, subtract):
    """``out[i]``: how many of the sorted ``edges`` are <= ``v[i] * inv`` (the nearest
    level), counted on from ``start[top 16 bits of v[i]]``; with ``subtract``,
    ``v -= table[code] * scale``."""
    bits = v.view(np.int32)
    for i in prange(v.shape[0]):
        a = _rank(edges, start[(bits[i] >> 16) & 0xFFFF], v[i] * inv)
        out[i] = a
        if subtract:
            v[i] = v[i] - table[a] * scale

@parallel
def lookup_scaled(codes, table, scale, out):
    """``out[i] = table[codes[i]] * scale`` (8-bit's decode; SketchML's with scale 1)."""
    for i in prange(out.shape[0]):
        out[i] = table[codes[i]] * scale

@parallel
def bucket_codes(v, edges, start, codes, q, chunks):
    """SketchML: ``codes[i]`` how many of the sorted ``edges`` are <= ``v[i]``, and per
    bucket the float64 sum and count of its values, returned as ``(sums, counts)``.
    The sums are taken over ``chunks`` fixed stretches of ``v`` and then added in
    order, so they do not depend on the number of threads.  ``start``: as for
    :func:`eightbit_codes`."""
    n = v.shape[0]
    bits = v.view(np.int32)
    size = (n + chunks - 1) // chunks
    part_sums = np.zeros((chunks, q))
    part_counts = np.zeros((chunks, q))
    for c in prange(chunks):
        for i in range(c * size, min(n, (c + 1) * size)):
            x = v[i]
            a = _rank(edges, start[(bits[i] >> 16) & 0xFFFF], x)
            codes[i] = a
            part_sums[c, a] += np.float64(x)
            part_counts[c, a] += 1.0
    sums = np.zeros(q)
    counts = np.zeros(q)
    for c in range(chunks):
        for b in range(q):
            sums[b] += part_sums[c, b]
            counts[b] += part_counts[c, b]
    return sums, counts

@parallel
def lookup_subtract(v, codes, table):
    """``v -= table[codes]`` in place (error feedback of a table codec)."""
    for i in prange(v.shape[0]):
        v[i] = v[i] - table[codes[i]]
