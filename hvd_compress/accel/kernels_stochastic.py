"""numba kernels that draw from a keyed hash: TernGrad's and QSGD's statistics passes and
codes, the integer sums' words and lanes, and the stratified sampler of random-k and DGC.

Without noise given, each element's uniform value is a two-round murmur3 hash of its
index under one 64-bit key drawn per step (``_fill_uniform``: the values TensorFlow's
compiled ops draw for the same key, ``tensorflow/fused/quantize_ops.cc``); with noise
given, the codes are the reference chain's bits.  The noise-taking kernels work block by
block (:data:`_BLOCK` values: noise, bucket factors, codes, packing, each loop
vectorised).  The statistics accumulate in float64 as the reference does, and are
non-finite exactly where a value is.  The wrappers are in :mod:`.host_stochastic`.
"""

import numpy as np

from .jit import inline, parallel, prange

_BLOCK = 4096  # values a block of the noise-taking kernels works on (a multiple of 8)

@parallel
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

@inline
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

@inline
def _fmix32(h):
    """murmur3's 32-bit finaliser (the hashed noise of TensorFlow's ops)."""
    return _mix32(h, np.uint64(0x85EBCA6B), np.uint64(13), np.uint64(0xC2B2AE35))

@inline
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

@inline
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

@parallel
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

@parallel
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

@parallel
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

@inline
def _lowbias32(x):
    """lowbias32 (:func:`hvd_compress.core.sampling.hash32`)."""
    return _mix32(x, np.uint64(0x7FEB352D), np.uint64(15), np.uint64(0x846CA68B))

@parallel
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

@parallel
def seg_stratified(starts, sizes, key0, key1, at, out):
    """Per segment ``s`` with ``sizes[s]`` > 0: :func:`stratified`'s ``sizes[s]`` indices
    of the segment ``[starts[s], starts[s+1])`` under keys ``key0[s]``, ``key1[s]``
    (uint64), plus ``starts[s]``, into ``out`` from ``at[s]`` on: the sampled positions
    of every chunk of a tensor (DGC's two-phase chunks, each its own stream)."""
    for s in prange(sizes.shape[0]):
        k = sizes[s]
        lo, n = starts[s], starts[s + 1] - starts[s]
        for j in range(k):
            first = (j * n) // k
            size = ((j + 1) * n) // k - first
            h = _lowbias32(_lowbias32(np.uint64(j) ^ key0[s]) ^ key1[s])
            out[at[s] + j] = lo + first + np.int64((h * np.uint64(size)) >> np.uint64(32))

@parallel
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

@parallel
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
