"""numba kernels of the sign codecs: threshold's 2-bit codes, 1-bit SGD (whole tensor and by
columns), signSGD / EF-signSGD, Signum's momentum step, and their decoders.

Each does a codec's per-element work -- codes, bit packing and, with error feedback,
the residual update -- in one parallel pass, with the reference chain's float32
arithmetic, so the bits are the chain's (``tests/test_kernels.py``).  Sign sums
accumulate in float64 as the reference does (1-bit by columns in numpy's order: the
same sums).  The wrappers are in :mod:`.host_signs`.
"""

import numpy as np

from .jit import parallel, prange


@parallel
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

@parallel
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

@parallel
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

@parallel
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

@parallel
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

@parallel
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

@parallel
def abs_sum(v):
    """Sum of |v| accumulated in float64 (EF-signSGD's scale)."""
    s = 0.0
    for i in prange(v.shape[0]):
        s += abs(np.float64(v[i]))
    return s

@parallel
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

@parallel
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

@parallel
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
