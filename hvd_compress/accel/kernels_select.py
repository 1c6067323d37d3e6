"""numba kernels of the selections: the k largest magnitudes from counts of float32 bit
patterns (top-k, adaptive quantization), the candidate gathers of top-k and DGC, DGC's
momentum correction, and INCEPTIONN's width codes and values.

Selections work over a fixed number of stretches of the tensor (set by its size, so the
bits never depend on the thread count); ties go to the lower index, as the reference's
selection.  The wrappers are in :mod:`.host_select`.
"""

import numpy as np

from .jit import inline, parallel, prange

_BLOCK = 4096  # values DGC's momentum pass handles (and gathers from) while in cache

@inline
def _group(w, by_sign):
    """The group of a value with float32 bits ``w`` for the selection kernels: by
    sign, 0 for ``v > 0``, 1 for ``v < 0`` and -1 for a zero (never chosen); by
    magnitude alone, 0 for every value."""
    if not by_sign:
        return 0
    if w & 0x7FFFFFFF == 0:
        return -1
    return 1 if w < 0 else 0

@parallel
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

@parallel
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

@inline
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

@inline
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

@parallel
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

@parallel
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

@parallel
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

@parallel
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

@parallel
def at_least(v, t, starts, out, vals, chunks):
    """The indices (increasing) of the values with ``|v| >= t``, each stretch's written
    from ``starts[stretch]`` on into ``out``, and the values into ``vals`` (where it
    is not empty): :func:`_gather` over each stretch."""
    n = v.shape[0]
    size = (n + chunks - 1) // chunks
    for c in prange(chunks):
        lo = c * size
        _gather(v[lo:min(n, lo + size)], lo, t, out, vals, starts[c])

@parallel
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

@parallel
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

@parallel
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
