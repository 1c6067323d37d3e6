"""Fused CPU kernels for the quantizers' host path (numba, optional).

The quantizers in :mod:`hvd_compress.core.quantizers` are written as chains of
array operations: clear, the same on every backend, and the reference.  In
host memory each operation is a pass over the tensor and, on a small machine,
each fresh temporary costs as much as the work.  These kernels do a codec's
per-element work -- codes, bit packing and, with error feedback, the residual
update -- in one parallel pass, with the same float32 arithmetic in the same
order, so they give the same bits (``tests/test_kernels.py`` compares them with
the reference chain).  The statistics (1-bit's sign sums, TernGrad's moments)
accumulate in float64 as the reference does, in another order: the float32
values derived from them agree unless a float64 result lies within about
1e-16 of a float32 rounding boundary, as between numpy, torch and TensorFlow.
1-bit by columns sums each column down the rows, numpy's order: the same sums.

They reach the core only through the backends' ``fused_encoder`` hook:
:mod:`hvd_compress.fastpaths` wraps them as the numpy backend's and the torch
backend's (CPU tensors) encoders, and imports this module (hence numba) on
first use.  ``HVD_COMPRESS_FUSED=0`` turns them off; device tensors take the
reference chain, and TensorFlow's CPU tensors the compiled ops of
:mod:`hvd_compress.tensorflow.fused_ops` (the same per-element work, written in
C++ against TensorFlow's kernel API).
"""

from __future__ import annotations

import numpy as np

from .fastpaths import requested

try:  # numba is an optional speed-up; everything works without it
    from numba import njit, prange
    AVAILABLE = True
except ImportError:  # pragma: no cover - numba is installed by scripts/setup.sh
    AVAILABLE = False

__all__ = ["AVAILABLE", "requested", "enabled", "threshold_pack", "onebit_pack", "sign_sums",
           "column_sign_sums", "onebit_pack_columns", "bit_decode_columns", "moments",
           "terngrad_pack", "qsgd_codes", "bucket_sumsq", "bucket_decode", "abs_sum", "natural_codes",
           "natural_decode", "lookup_2bit",
           "bit_decode", "signum_step",
           "bucket_minmax", "uniform_codes", "eightbit_codes", "lookup_scaled",
           "bucket_codes", "lookup_subtract", "top_counts", "top_select",
           "dgc_momentum", "dgc_sample", "stratified", "count_at_least", "at_least", "add_count",
           "inceptionn_widths", "inceptionn_pack", "inceptionn_decode", "intsum_words",
           "intsum_lanes"]


def enabled() -> bool:
    """Whether the kernels are installed and not turned off."""
    return AVAILABLE and requested()


_BLOCK = 4096  # values a block of the noise-taking kernels works on (a multiple of 8)

if AVAILABLE:
    _jit = njit(parallel=True, nogil=True, cache=True, fastmath=False, error_model="numpy")

    @_jit
    def threshold_pack(v, tau, out, subtract):
        """2-bit codes of ``v`` against ``tau`` (1: >= tau, 2: <= -tau, else 0) packed
        4 a byte; with ``subtract``, ``v`` keeps the residual ``v - decoded``."""
        n = v.shape[0]
        for q in prange(out.shape[0]):
            b = 0
            for j in range(4):
                i = q * 4 + j
                if i < n:
                    x = v[i]
                    if x >= tau:
                        b |= 1 << (2 * j)
                        if subtract:
                            v[i] = x - tau
                    elif x <= -tau:
                        b |= 2 << (2 * j)
                        if subtract:
                            v[i] = x - (-tau)
            out[q] = b

    @_jit
    def onebit_pack(v, pos, neg, out, subtract):
        """Sign bits (1: v >= 0) packed 8 a byte; with ``subtract``, ``v -= pos`` where
        the bit is 1 and ``v -= neg`` where it is 0 (one column)."""
        n = v.shape[0]
        by_sign = np.asarray([neg, pos], np.float32)
        for q in prange(out.shape[0]):
            b = 0
            for j in range(8):
                i = q * 8 + j
                if i < n:
                    x = v[i]
                    p = np.int32(x >= 0)  # no branch on a sign: the signs are a coin toss
                    b |= p << j
                    if subtract:
                        v[i] = x - by_sign[p]
            out[q] = b

    @_jit
    def sign_sums(v):
        """(count of v >= 0, sum of those, sum of the rest), float64 accumulation."""
        npos = 0
        spos = 0.0
        sneg = 0.0
        for i in prange(v.shape[0]):
            x = np.float64(v[i])
            # no branch on the sign (a coin toss): adding +-0.0 leaves a sum as it is
            npos += x >= 0
            spos += max(x, 0.0)
            sneg += min(x, 0.0)
        return npos, spos, sneg

    _COLUMN_BLOCK = 64  # columns a thread sums down the rows at a time

    @_jit
    def column_sign_sums(m, npos, total, spos):
        """Per column of the row-major matrix ``m``: the count of values >= 0 (``npos``)
        and the float64 sums of all values (``total``) and of the non-negative ones
        (``spos``), each accumulated from 0 down the rows in order -- the order of
        numpy's sum over axis 0, so the reference's bits.  Threads take blocks of
        columns, summed in local accumulators (2.5-5x faster than in the outputs)."""
        rows, cols = m.shape
        for blk in prange((cols + _COLUMN_BLOCK - 1) // _COLUMN_BLOCK):
            lo = blk * _COLUMN_BLOCK
            w = min(cols, lo + _COLUMN_BLOCK) - lo
            cnt = np.zeros(_COLUMN_BLOCK, np.int64)
            tot = np.zeros(_COLUMN_BLOCK)
            pos = np.zeros(_COLUMN_BLOCK)
            for r in range(rows):
                row = m[r, lo:lo + w]
                for j in range(w):
                    x = np.float64(row[j])
                    cnt[j] += x >= 0
                    tot[j] += x
                    pos[j] += max(x, 0.0)  # -0.0 or +0.0 added to a sum that starts at +0.0
            npos[lo:lo + w] = cnt[:w]
            total[lo:lo + w] = tot[:w]
            spos[lo:lo + w] = pos[:w]

    @_jit
    def onebit_pack_columns(v, neg, pos, out, subtract):
        """Sign bits (1: v >= 0) of flat ``v`` packed 8 a byte; with ``subtract``, ``v -=
        pos[c]`` or ``neg[c]`` for the element's column ``c`` (``len(pos)`` columns).
        Written as a choice between the two (a look-up indexed by the sign bit took
        four times as long)."""
        n = v.shape[0]
        cols = pos.shape[0]
        for q in prange(out.shape[0]):
            b = 0
            c = (q * 8) % cols
            for j in range(8):
                i = q * 8 + j
                if i < n:
                    x = v[i]
                    b |= np.int32(x >= 0) << j
                    if subtract:
                        v[i] = x - (pos[c] if x >= 0 else neg[c])
                    c += 1
                    if c == cols:
                        c = 0
            out[q] = b

    @_jit
    def bit_decode_columns(signs, neg, pos, out):
        """``out[i] = pos[c]`` where bit ``i`` of ``signs`` is 1, else ``neg[c]``, for
        the element's column ``c`` (1-bit SGD by columns)."""
        n = out.shape[0]
        cols = pos.shape[0]
        for q in prange(signs.shape[0]):
            b = np.int32(signs[q])
            c = (q * 8) % cols
            for j in range(8):
                i = q * 8 + j
                if i < n:
                    out[i] = pos[c] if (b >> j) & 1 else neg[c]
                    c += 1
                    if c == cols:
                        c = 0

    @_jit
    def moments(v):
        """(sum of v, sum of v*v, max |v|), products and sums in float64 (as the reference);
        a NaN or Inf in ``v`` makes one of the sums non-finite (float32 squares cannot
        overflow float64), so they also answer whether ``v`` is finite."""
        s1 = 0.0
        s2 = 0.0
        top = np.float32(0.0)
        for i in prange(v.shape[0]):
            x = np.float64(v[i])
            s1 += x
            s2 += x * x
            top = max(top, abs(v[i]))
        return s1, s2, top

    @njit(nogil=True, cache=True, inline="always")
    def _mix32(h, m1, s, m2):
        """A 32-bit xorshift-multiply finaliser on a value held in 64 bits (kept below
        2**32): ``h ^= h >> 16; h *= m1; h ^= h >> s; h *= m2; h ^= h >> 16`` -- murmur3's
        (m1, s, m2 = 0x85EBCA6B, 13, 0xC2B2AE35) and lowbias32 (0x7FEB352D, 15,
        0x846CA68B)."""
        h ^= h >> np.uint64(16)
        h = (h * m1) & np.uint64(0xFFFFFFFF)
        h ^= h >> s
        h = (h * m2) & np.uint64(0xFFFFFFFF)
        return h ^ (h >> np.uint64(16))

    @njit(nogil=True, cache=True, inline="always")
    def _fmix32(h):
        """murmur3's 32-bit finaliser (the hashed noise of TensorFlow's ops)."""
        return _mix32(h, np.uint64(0x85EBCA6B), np.uint64(13), np.uint64(0xC2B2AE35))

    @njit(nogil=True, cache=True, inline="always")
    def _fill_uniform(noise, start, m, k0, k1, u):
        """``u[:m]``: the uniform [0, 1) values of elements ``start .. start+m``: the noise
        given, or (``noise`` empty) a two-round hash of each index under the 64-bit key
        ``(k1, k0)`` with 24 random bits -- the values TensorFlow's compiled ops draw
        (``fused/quantize_ops.cc``).  A loop without branches: it vectorises."""
        if noise.shape[0]:
            ns = noise[start:start + m]
            for j in range(m):
                u[j] = ns[j]
            return
        lo = np.uint64(start) & np.uint64(0xFFFFFFFF)
        k1x = k1 ^ (np.uint64(start) >> np.uint64(32))  # a block never straddles 2**32
        for j in range(m):
            h = ((lo + np.uint64(j)) * np.uint64(0x9E3779B1) + k0) & np.uint64(0xFFFFFFFF)
            h = _fmix32(_fmix32(h) ^ k1x)
            u[j] = np.float32(np.int32(h >> np.uint64(8))) * np.float32(1.0 / 16777216.0)

    @njit(nogil=True, cache=True, inline="always")
    def _bucket_factors(factors, start, m, d, f):
        """``f[:m]``: each of the values ``start .. start+m``'s bucket factor
        ``factors[(start + t) // d]``, filled run by run (a division per bucket, not per
        value)."""
        j = 0
        while j < m:
            q = (start + j) // d
            end = min(m, (q + 1) * d - start)
            for t in range(j, end):
                f[t] = factors[q]
            j = end

    @_jit
    def terngrad_pack(v, noise, k0, k1, cap, safe, out):
        """TernGrad codes (1: +1, 2: -1, 0) with P(keep) = min(|v|, cap) / safe, packed
        4 a byte; the noise given, or hashed under the key (:func:`_fill_uniform`).
        Block by block (:data:`_BLOCK` values): noise, codes, packing, each loop
        vectorised."""
        n = v.shape[0]
        blocks = (n + _BLOCK - 1) // _BLOCK
        for b in prange(blocks):
            u = np.empty(_BLOCK, np.float32)
            code = np.zeros(_BLOCK + 3, np.int32)
            start = b * _BLOCK
            m = min(_BLOCK, n - start)
            _fill_uniform(noise, start, m, k0, k1, u)
            vs = v[start:start + m]
            for j in range(m):
                x = vs[j]
                keep = np.int32(u[j] < min(abs(x), cap) / safe)  # a select, not a branch
                code[j] = keep + keep * np.int32(x < 0)
            o = start // 4
            for q in range((m + 3) // 4):
                out[o + q] = code[4 * q] | code[4 * q + 1] << 2 | code[4 * q + 2] << 4 | \
                    code[4 * q + 3] << 6

    @_jit
    def qsgd_codes(v, inv, noise, k0, k1, s, d, packed, out):
        """QSGD codes s + sign * min(floor(|v| * inv[bucket] + u), s); packed 2 a byte
        when ``packed`` (4-bit codes), else one a byte; ``u`` the noise given, or hashed
        under the key (:func:`_fill_uniform`).  Block by block (:data:`_BLOCK` values):
        noise, each value's bucket factor, codes, packing, each loop vectorised."""
        n = v.shape[0]
        blocks = (n + _BLOCK - 1) // _BLOCK
        for b in prange(blocks):
            u = np.empty(_BLOCK, np.float32)
            f = np.empty(_BLOCK, np.float32)
            code = np.zeros(_BLOCK + 1, np.int32)
            start = b * _BLOCK
            m = min(_BLOCK, n - start)
            _fill_uniform(noise, start, m, k0, k1, u)
            _bucket_factors(inv, start, m, d, f)
            vs = v[start:start + m]
            for t in range(m):
                x = vs[t]
                # floor of a non-negative value: its truncation (no libm call)
                lv = min(np.int32(abs(x) * f[t] + u[t]), s)
                code[t] = s + lv - 2 * lv * np.int32(x < 0)  # no branch on the sign
            if packed:
                o = start // 2
                for t in range((m + 1) // 2):
                    out[o + t] = code[2 * t] | code[2 * t + 1] << 4
            else:
                for t in range(m):
                    out[start + t] = code[t]

    @_jit
    def bucket_sumsq(v, d):
        """Per bucket of ``d`` values, the sum of squares accumulated in float64."""
        n = v.shape[0]
        nb = (n + d - 1) // d
        out = np.empty(nb)
        for b in prange(nb):
            t = 0.0
            for i in range(b * d, min(n, (b + 1) * d)):
                x = np.float64(v[i])
                t += x * x
            out[b] = t
        return out

    @_jit
    def abs_sum(v):
        """Sum of |v| accumulated in float64 (EF-signSGD's scale)."""
        s = 0.0
        for i in prange(v.shape[0]):
            s += abs(np.float64(v[i]))
        return s

    @_jit
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

    @_jit
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

    @_jit
    def bit_decode(signs, table, out):
        """``out[i] = table[bit i of signs]`` (1-bit codes packed 8 a byte: the sign
        codecs' ``[-scale, scale]``, 1-bit SGD's ``[neg, pos]``)."""
        n = out.shape[0]
        for q in prange(signs.shape[0]):
            b = np.int32(signs[q])
            for j in range(8):
                i = q * 8 + j
                if i < n:
                    out[i] = table[(b >> j) & 1]

    @_jit
    def signum_step(m, g, beta, rest, fresh, signs):
        """Signum: ``fresh = m * beta + g * rest`` (float32, the chain's order), its sign
        bits (1: >= 0) packed 8 a byte; returns (all finite, any nonzero)."""
        n = m.shape[0]
        bad = 0
        nonzero = 0
        for q in prange(signs.shape[0]):
            b = 0
            for j in range(8):
                i = q * 8 + j
                if i < n:
                    x = m[i] * beta + g[i] * rest
                    fresh[i] = x
                    b |= np.int32(x >= 0) << j  # no branches on the signs
                    nonzero += x != 0
                    bad += 1 - np.int64(np.isfinite(x))
            signs[q] = b
        return bad == 0, nonzero > 0

    @_jit
    def lookup_2bit(codes, table, out):
        """``out[i] = table[code i]`` for 2-bit codes packed 4 a byte (TernGrad's and
        threshold's decode: the table is ``[0, 1, -1, 0] * scale``)."""
        n = out.shape[0]
        for q in prange(codes.shape[0]):
            b = np.int32(codes[q])
            for j in range(4):
                i = q * 4 + j
                if i < n:
                    out[i] = table[(b >> (2 * j)) & 3]

    @_jit
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

    @njit(nogil=True, cache=True, inline="always")
    def _groups(n, nbytes, per, d):
        """How the uniform kernels split their bytes: by bucket (``span`` bytes a group,
        the bucket known without a division) where buckets hold whole bytes and are
        many, else byte by byte; returns ``(groups, span, by_bucket)``."""
        nb = (n + d - 1) // d
        if d % per == 0 and nb >= 16:
            return nb, d // per, True
        return nbytes, 1, False

    @_jit
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

    @_jit
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

    @njit(nogil=True, cache=True, inline="always")
    def _rank(edges, a, x):
        """How many of the sorted ``edges`` are <= ``x``, counting on from ``a`` (a count
        known not to exceed it: the start table's, see ``fastpaths.start_table``)."""
        m = edges.shape[0]
        while a < m and edges[a] <= x:
            a += 1
        return a

    @_jit
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

    @_jit
    def lookup_scaled(codes, table, scale, out):
        """``out[i] = table[codes[i]] * scale`` (8-bit's decode; SketchML's with scale 1)."""
        for i in prange(out.shape[0]):
            out[i] = table[codes[i]] * scale

    @_jit
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

    @_jit
    def lookup_subtract(v, codes, table):
        """``v -= table[codes]`` in place (error feedback of a table codec)."""
        for i in prange(v.shape[0]):
            v[i] = v[i] - table[codes[i]]

    @njit(nogil=True, cache=True, inline="always")
    def _group(w, by_sign):
        """The group of a value with float32 bits ``w`` for the selection kernels: by
        sign, 0 for ``v > 0``, 1 for ``v < 0`` and -1 for a zero (never chosen); by
        magnitude alone, 0 for every value."""
        if not by_sign:
            return 0
        if w & 0x7FFFFFFF == 0:
            return -1
        return 1 if w < 0 else 0

    @_jit
    def top_counts(v, high, chunks, by_sign):
        """Per stretch of ``v`` (``chunks`` of them) and group (:func:`_group`), how many
        values have each bit pattern of ``|v|``'s float32 bits (int32 counts; larger
        patterns are larger magnitudes): with ``high`` empty, of the top 16 bits
        (32,768 patterns); else of the low 16 bits (65,536), counting only the values
        whose top 16 bits are ``high[group]`` (-1: none)."""
        n = v.shape[0]
        bits = v.view(np.int32)
        size = (n + chunks - 1) // chunks
        low = high.shape[0] > 0
        counts = np.zeros((chunks, 2, 65536 if low else 32768), np.int32)
        for c in prange(chunks):
            for i in range(c * size, min(n, (c + 1) * size)):
                w = bits[i]
                g = _group(w, by_sign)
                a = w & 0x7FFFFFFF
                if g < 0:
                    continue
                if not low:
                    counts[c, g, a >> 16] += 1
                elif (a >> 16) == high[g]:
                    counts[c, g, a & 0xFFFF] += 1
        return counts

    @_jit
    def top_select(v, cut, ties, starts, first, second, chunks, by_sign):
        """Per group, the indices (increasing) of the values whose ``|v|`` bits exceed
        ``cut[group]``, and of those equal to it the ``ties[chunk, group]`` first of
        each stretch, written from ``starts[chunk, group]`` on into ``first`` (group
        0) and ``second`` (group 1).  64 values at a time are first counted against the
        lower cut (a loop that vectorises); only groups with one are looked at again."""
        n = v.shape[0]
        bits = v.view(np.int32)
        size = (n + chunks - 1) // chunks
        low = min(cut[0], cut[1])
        for c in prange(chunks):
            at0 = starts[c, 0]
            at1 = starts[c, 1]
            left0 = ties[c, 0]
            left1 = ties[c, 1]
            end = min(n, (c + 1) * size)
            for b in range(c * size, end, 64):
                ws = bits[b:min(end, b + 64)]
                hits = 0
                for j in range(ws.shape[0]):
                    hits += np.int32(np.int64(ws[j] & 0x7FFFFFFF) >= low)
                if hits == 0:
                    continue
                for j in range(ws.shape[0]):
                    i = b + j
                    w = ws[j]
                    g = _group(w, by_sign)
                    a = np.int64(w & 0x7FFFFFFF)
                    if g == 0:
                        if a > cut[0] or (a == cut[0] and left0 > 0):
                            if a == cut[0]:
                                left0 -= 1
                            first[at0] = i
                            at0 += 1
                    elif g == 1 and (a > cut[1] or (a == cut[1] and left1 > 0)):
                        if a == cut[1]:
                            left1 -= 1
                        second[at1] = i
                        at1 += 1

    @njit(nogil=True, cache=True, inline="always")
    def _lowbias32(x):
        """lowbias32 (:func:`hvd_compress.core.sampling.hash32`)."""
        return _mix32(x, np.uint64(0x7FEB352D), np.uint64(15), np.uint64(0x846CA68B))

    @_jit
    def stratified(n, k, key0, key1, indices, sizes):
        """:func:`hvd_compress.core.sampling.stratified_indices` in one pass: stratum
        ``j`` is ``[j*n//k, (j+1)*n//k)``, its index ``lo + (h_j * size) >> 32`` for the
        keyed hash ``h_j``; int64 results into ``indices`` and ``sizes``.  The bounds
        step on without a division: with ``n = q*k + rem``, ``j*n//k = j*q + j*rem//k``,
        whose remainder grows by ``rem`` a stratum (one division a block of strata)."""
        q, rem = n // k, n % k
        for b in prange((k + _BLOCK - 1) // _BLOCK):
            j0 = np.int64(b) * _BLOCK
            r = j0 * rem % k  # (j*rem) mod k, < k
            hi = j0 * q + j0 * rem // k
            for j in range(j0, min(k, j0 + _BLOCK)):
                lo = hi
                r += rem
                hi = lo + q
                if r >= k:
                    r -= k
                    hi += 1
                size = hi - lo
                h = _lowbias32(_lowbias32(np.uint64(j) ^ key0) ^ key1)
                indices[j] = lo + np.int64((h * np.uint64(size)) >> np.uint64(32))
                sizes[j] = size

    @njit(nogil=True, cache=True, inline="always")
    def _gather(vs, base, t, out, vals, at):
        """Write the positions (``base + i``, increasing) of ``|vs[i]| >= t`` into ``out``
        from ``at`` on, and their values into ``vals`` (where it is not empty); returns the
        next ``at``.  64 values at a time are counted first (a loop that vectorises), and
        only the groups with one are looked at again."""
        keep = vals.shape[0] > 0
        for q in range(0, vs.shape[0], 64):
            ws = vs[q:min(vs.shape[0], q + 64)]
            hits = 0
            for i in range(ws.shape[0]):
                hits += np.int32(abs(ws[i]) >= t)
            if hits:
                for i in range(ws.shape[0]):
                    x = ws[i]
                    if abs(x) >= t:
                        out[at] = base + q + i
                        if keep:
                            vals[at] = x
                        at += 1
        return at

    @njit(nogil=True, cache=True, inline="always")
    def _gather_block(vs, base, hits, t, out, vals, at, end):
        """After a block's pass (:data:`_BLOCK` values at most, still in cache) found
        ``hits`` values at or above ``t``: gather them (:func:`_gather`) where they fit
        before ``end``; returns the next ``at``, or ``end + 1`` once they did not fit
        (the stretch's gather is then abandoned: the caller gathers again)."""
        if hits == 0 or at > end:
            return at
        if at + hits > end:
            return end + 1
        return _gather(vs, base, t, out, vals, at)

    @_jit
    def add_count(r, g, t, add, chunks):
        """With ``add``, ``r += g`` in place (error feedback's sum, float32); per stretch
        (``chunks`` of them), how many of the new ``|r|`` (without ``add``: of ``|g|``)
        are ``>= t``, and how many are not finite (int64 each)."""
        n = g.shape[0]
        size = (n + chunks - 1) // chunks
        counts = np.zeros(chunks, np.int64)
        bad = np.zeros(chunks, np.int64)
        top = np.float32(3.4028234663852886e38)
        for c in prange(chunks):
            lo, hi = c * size, min(n, (c + 1) * size)
            gs, rs = g[lo:hi], r[lo:hi]
            got = 0
            odd = 0
            if add:
                for i in range(hi - lo):
                    y = rs[i] + gs[i]
                    rs[i] = y
                    a = abs(y)
                    got += np.int64(a >= t)
                    odd += np.int64(a > top) | np.int64(a != a)
            else:
                for i in range(hi - lo):
                    a = abs(gs[i])
                    got += np.int64(a >= t)
                    odd += np.int64(a > top) | np.int64(a != a)
            counts[c] = got
            bad[c] = odd
        return counts, bad

    @_jit
    def dgc_momentum(g, u, v, m, nesterov, t0, t1, chunks, out, vals, cap):
        """DGC's momentum correction in place, the chain's float32 arithmetic: ``u = u*m +
        g; v = v + u`` (Nesterov: ``u = (u + g)*m; v = (v + u) + g``); returns, per
        stretch (``chunks`` of them), how many of the new ``|v|`` are ``>= t0`` and
        ``>= t1``, and how many of the former were gathered (int64, shape (chunks, 3)):
        each block's values at or above ``t0`` are gathered while the block is in cache
        (:func:`_gather_block`), stretch ``c``'s into ``out``/``vals`` from ``c * cap``
        on, at most ``cap`` of them (more: -1 gathered, the caller gathers again).  Each
        block is a slice indexed from 0: the loop vectorises (indexed from the stretch's
        start it did not).  (Top-k's candidates, about 1% of the values, are gathered
        faster by a pass of their own: :func:`at_least`.)"""
        n = v.shape[0]
        size = (n + chunks - 1) // chunks
        counts = np.zeros((chunks, 3), np.int64)
        for c in prange(chunks):
            lo, hi = c * size, min(n, (c + 1) * size)
            at, end = c * cap, (c + 1) * cap
            c0 = 0
            c1 = 0
            for b in range(lo, hi, _BLOCK):
                e = min(hi, b + _BLOCK)
                gs, us, vs = g[b:e], u[b:e], v[b:e]
                h0 = 0
                if nesterov:
                    for i in range(e - b):
                        x = (us[i] + gs[i]) * m
                        us[i] = x
                        y = (vs[i] + x) + gs[i]
                        vs[i] = y
                        h0 += np.int64(abs(y) >= t0)
                        c1 += np.int64(abs(y) >= t1)
                else:
                    for i in range(e - b):
                        x = us[i] * m + gs[i]
                        us[i] = x
                        y = vs[i] + x
                        vs[i] = y
                        h0 += np.int64(abs(y) >= t0)
                        c1 += np.int64(abs(y) >= t1)
                at = _gather_block(vs, b, h0, t0, out, vals, at, end)
                c0 += h0
            counts[c, 0] = c0
            counts[c, 1] = c1
            counts[c, 2] = at - c * cap if at <= end else -1
        return counts

    @_jit
    def dgc_sample(g, u, v, pos, m, nesterov):
        """``|v|`` after DGC's momentum correction at positions ``pos`` (nothing written)."""
        out = np.empty(pos.shape[0], np.float32)
        for j in prange(pos.shape[0]):
            i = pos[j]
            if nesterov:
                x = (u[i] + g[i]) * m
                out[j] = abs((v[i] + x) + g[i])
            else:
                out[j] = abs(v[i] + (u[i] * m + g[i]))
        return out

    @_jit
    def count_at_least(v, t, chunks):
        """Per stretch, how many ``|v| >= t`` (int64)."""
        n = v.shape[0]
        size = (n + chunks - 1) // chunks
        counts = np.zeros(chunks, np.int64)
        for c in prange(chunks):
            vs = v[c * size:min(n, (c + 1) * size)]
            got = 0
            for i in range(vs.shape[0]):
                got += np.int64(abs(vs[i]) >= t)
            counts[c] = got
        return counts

    @_jit
    def at_least(v, t, starts, out, vals, chunks):
        """The indices (increasing) of the values with ``|v| >= t``, each stretch's written
        from ``starts[stretch]`` on into ``out``, and the values into ``vals`` (where it
        is not empty): :func:`_gather` over each stretch."""
        n = v.shape[0]
        size = (n + chunks - 1) // chunks
        for c in prange(chunks):
            lo = c * size
            _gather(v[lo:min(n, lo + size)], lo, t, out, vals, starts[c])

    @_jit
    def inceptionn_widths(v, inv, codes, chunks):
        """INCEPTIONN: the width code of ``q = floor(float64(v) * inv + 0.5)`` (0: q = 0,
        1: |q| <= 127, 2: |q| <= 32767, else 3) packed 4 a byte, and per stretch of
        ``v`` (a multiple of 4 values long) how many values take widths 3, 2 and 1.
        ``floor(y) >= m`` is ``y >= m`` for an integer ``m``: comparisons, no floor."""
        n = v.shape[0]
        size = ((n + chunks - 1) // chunks + 3) // 4 * 4
        counts = np.zeros((chunks, 3), np.int64)
        for c in prange(chunks):
            end = min(n, (c + 1) * size)
            c3 = 0
            c2 = 0
            c1 = 0
            for q in range(c * size // 4, (end + 3) // 4):
                b = 0
                for j in range(4):
                    i = q * 4 + j
                    if i < end:
                        y = np.float64(v[i]) * inv + 0.5
                        w = np.int32((y >= 1.0) | (y < 0.0)) + np.int32((y >= 128.0) | (y < -127.0)) \
                            + np.int32((y >= 32768.0) | (y < -32767.0))
                        c3 += w == 3
                        c2 += w == 2
                        c1 += w == 1
                        b |= w << (2 * j)
                codes[q] = b
            counts[c, 0] = c3
            counts[c, 1] = c2
            counts[c, 2] = c1
        return counts

    @_jit
    def inceptionn_pack(v, inv, starts, ends, wide, mid, low, chunks):
        """INCEPTIONN's values by width, each stretch into ``[starts, ends)`` of ``wide``
        (float32 as they are), ``mid`` (int16 q) and ``low`` (uint8 q + 128).  Every
        value is written to each array's next slot, which only the values of its width
        move on (the slot's last write is the right one), so there is no branch to
        mispredict; a stretch whose slots are all filled writes to its own spare slot
        past the end (the arrays have ``16 * chunks``, ``32 * chunks`` and ``64 * chunks``
        spare entries)."""
        n = v.shape[0]
        size = ((n + chunks - 1) // chunks + 3) // 4 * 4
        for c in prange(chunks):
            a3 = starts[c, 0]
            a2 = starts[c, 1]
            a1 = starts[c, 2]
            e3 = ends[c, 0]
            e2 = ends[c, 1]
            e1 = ends[c, 2]
            s3 = wide.shape[0] - 16 * (c + 1)
            s2 = mid.shape[0] - 32 * (c + 1)
            s1 = low.shape[0] - 64 * (c + 1)
            for i in range(c * size, min(n, (c + 1) * size)):
                x = v[i]
                y = np.float64(x) * inv + 0.5
                # the widths as inceptionn_widths takes them (a NaN y, from an infinite
                # inv, is width 0 in both)
                big = (y >= 32768.0) | (y < -32767.0)
                m = ((y >= 128.0) | (y < -127.0)) & ~big
                one = ((y >= 1.0) | (y < 0.0)) & ~big & ~m
                t = np.int64(min(max(y, -1e18), 1e18))  # within int64 (used for m, one)
                t -= np.int64(t > y)  # floor
                wide[a3 if a3 < e3 else s3] = x
                mid[a2 if a2 < e2 else s2] = np.int16(t)
                low[a1 if a1 < e1 else s1] = np.uint8(t + 128)
                a3 += big
                a2 += m
                a1 += one

    @_jit
    def inceptionn_decode(codes, wide, mid, low, step, out, chunks, per_byte):
        """INCEPTIONN's values from their width codes: ``wide`` as they are, ``mid`` and
        ``low - 128`` times ``step`` (float64, then float32), 0 for width 0.  Each
        stretch's offsets from counts by code byte (``per_byte[b]``: how many codes of
        widths 3, 2, 1 byte ``b`` holds); values selected, not branched on (``wide``,
        ``mid``, ``low`` have at least one entry)."""
        n = out.shape[0]
        size = ((n + chunks - 1) // chunks + 3) // 4 * 4
        counts = np.zeros((chunks + 1, 3), np.int64)
        for c in prange(chunks):
            s3 = 0
            s2 = 0
            s1 = 0
            for q in range(c * size // 4, min((n + 3) // 4, (c + 1) * size // 4)):
                b = codes[q]
                s3 += per_byte[b, 0]
                s2 += per_byte[b, 1]
                s1 += per_byte[b, 2]
            counts[c + 1, 0] = s3
            counts[c + 1, 1] = s2
            counts[c + 1, 2] = s1
        for c in range(chunks):
            for w in range(3):
                counts[c + 1, w] += counts[c, w]
        last3 = wide.shape[0] - 1
        last2 = mid.shape[0] - 1
        last1 = low.shape[0] - 1
        for c in prange(chunks):
            a3 = counts[c, 0]
            a2 = counts[c, 1]
            a1 = counts[c, 2]
            for i in range(c * size, min(n, (c + 1) * size)):
                w = (codes[i >> 2] >> (2 * (i & 3))) & 3
                r = np.float32((np.float64(low[min(a1, last1)]) - 128.0) * step) if w == 1 \
                    else np.float32(0.0)
                r = np.float32(np.float64(mid[min(a2, last2)]) * step) if w == 2 else r
                r = wide[min(a3, last3)] if w == 3 else r
                out[i] = r
                a1 += w == 1
                a2 += w == 2
                a3 += w == 3

    @_jit
    def intsum_words(v, noise, k0, k1, kind, cap, safe, inv, d, m, w, bias, out):
        """Integer sums' codes (:mod:`hvd_compress.core.intsum`) straight into int32 words of
        ``w``-bit lanes: biased codes ``c + 2**(w-1)`` packed, minus ``bias`` (``C``,
        unsigned), modulo 2**32.  ``kind`` 0: TernGrad, ``|c| = [u < min(|v|, cap) / safe]``;
        1: QSGD, ``|c| = min(floor(|v| * inv[bucket] + u), m)``; 2: signSGD, ``|c| = [v !=
        0]``; ``c`` takes ``v``'s sign.  ``u``: the noise given, or hashed under the key
        (:func:`_fill_uniform`).  Lanes past ``n`` hold 0 (the chain's padding)."""
        n = v.shape[0]
        per = 32 // w
        h = np.int64(1) << np.int64(w - 1)
        blocks = (n + _BLOCK - 1) // _BLOCK
        for b in prange(blocks):
            u = np.empty(_BLOCK, np.float32)
            f = np.empty(_BLOCK, np.float32)
            e = np.zeros(_BLOCK + 8, np.int64)
            start = b * _BLOCK
            mm = min(_BLOCK, n - start)
            if kind != 2:
                _fill_uniform(noise, start, mm, k0, k1, u)
            if kind == 1:
                _bucket_factors(inv, start, mm, d, f)
            vs = v[start:start + mm]
            for t in range(mm):
                x = vs[t]
                if kind == 0:
                    lv = np.int64(u[t] < min(abs(x), cap) / safe)
                elif kind == 1:
                    lv = np.int64(min(np.int32(abs(x) * f[t] + u[t]), m))
                else:
                    lv = np.int64(x != 0)
                e[t] = h + lv - 2 * lv * np.int64(x < 0)
            o = start // per  # blocks start on whole words (_BLOCK is a multiple of 8)
            for q in range((mm + per - 1) // per):
                word = np.int64(0)
                for j in range(per):
                    word |= e[q * per + j] << np.int64(w * j)
                word = (word - bias) & np.int64(0xFFFFFFFF)
                if word >= np.int64(1) << np.int64(31):
                    word -= np.int64(1) << np.int64(32)
                out[o + q] = np.int32(word)

    @_jit
    def intsum_lanes(words, n, w, bias, unit, d, vote, out):
        """The lane sums of summed words as floats: ``(W + C)``'s lane minus ``2**(w-1)``,
        times ``unit[i // d]`` (none given: 1), or its sign (``vote``).  Block by block
        (:data:`_BLOCK` values, whole words): each value's factor, run by run, then the
        lanes word by word."""
        per = 32 // w
        h = np.int64(1) << np.int64(w - 1)
        mask = (np.int64(1) << np.int64(w)) - 1
        scaled = unit.shape[0] > 0
        blocks = (n + _BLOCK - 1) // _BLOCK
        for b in prange(blocks):
            f = np.ones(_BLOCK + 8, np.float32)
            lanes = np.empty(_BLOCK + 8, np.float32)
            start = b * _BLOCK
            mm = min(_BLOCK, n - start)
            if scaled:
                _bucket_factors(unit, start, mm, d, f)
            o = start // per
            for q in range((mm + per - 1) // per):
                word = (np.int64(words[o + q]) + bias) & np.int64(0xFFFFFFFF)
                for j in range(per):
                    lanes[q * per + j] = np.float32(((word >> np.int64(w * j)) & mask) - h)
            if vote:
                for t in range(mm):
                    out[start + t] = np.float32(lanes[t] > 0) - np.float32(lanes[t] < 0)
            elif scaled:
                for t in range(mm):
                    out[start + t] = lanes[t] * f[t]
            else:
                for t in range(mm):
                    out[start + t] = lanes[t]


else:  # pragma: no cover
    threshold_pack = onebit_pack = terngrad_pack = qsgd_codes = sign_sums = moments = None
    bucket_sumsq = bucket_decode = lookup_2bit = None
    abs_sum = natural_codes = natural_decode = bit_decode = signum_step = bucket_minmax = None
    uniform_codes = eightbit_codes = lookup_scaled = bucket_codes = lookup_subtract = None
    top_counts = top_select = dgc_momentum = None
    inceptionn_widths = inceptionn_pack = inceptionn_decode = None
    intsum_words = intsum_lanes = None
