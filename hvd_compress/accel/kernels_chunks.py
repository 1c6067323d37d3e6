"""numba kernels of the two-phase exchange's chunks, all of a tensor's in one call (the
wrappers: :mod:`.host_chunks`).

The two-phase exchange (:mod:`hvd_compress.core.twophase`) cuts each tensor into ``p``
chunks; encoded one call each, a tensor costs ``p + 1`` encodes and ``2 p`` decodes, and
at 1,024 workers the calls' fixed cost (Python, dispatch: 0.1-0.6 ms each) outweighs their
values.  These kernels take every chunk of a tensor at once: segment ``s`` is
``[starts[s], starts[s+1])``, each summed and packed in index order by one thread, as
the serial kernels of :mod:`.kernels_signs` do one chunk (so their bits).  Payloads are
read and written at byte offsets in one buffer (a received row, an allgather's table).

The error-feedback passes over one whole tensor are here too -- 1-bit's
(``ef_sign_sums``, ``ef_onebit_pack``: threads over its values, the reduction of
:func:`~.kernels_signs.sign_sums`) and top-k's (``ef_count``, ``ef_add_gather``: threads
over fixed stretches) -- as they and the segments' kernels take the same per-value steps
(:func:`_ef_value`, :func:`_ef_byte`), and a kernel module keeps the helpers it inlines
(:mod:`.jit`).

Top-k's segments are selected exactly (the k largest magnitudes, ties to the lower
index: the core's :func:`~hvd_compress.core.sparsifiers.topk_indices` set), so their
bits depend on no order; a payload is ``k`` int32 indices then ``k`` float32 values,
read and written through views of the byte buffer at its offset.  DGC's segments
(``seg_dgc_thresholds``, ``seg_dgc_pack``) take the same payload and exact selection, after
each segment's momentum correction, sampled threshold and correction loop.
"""

import numpy as np

from .jit import inline, parallel, prange

_TOP = np.float32(3.4028234663852886e38)
#: top-k segments of this many values or more find the k-th largest magnitude among the
#: values of its histogram bin and above (bins: the float32 bit pattern >> 19, 4,096);
#: smaller ones among all of their values
_BINNED_FROM = 1 << 14


@inline
def _ef_value(r, g, i):
    """``y = r[i] + g[i]`` (float32: error feedback's sum, not stored) and 1 where it is
    not finite, else 0."""
    y = r[i] + g[i]
    a = abs(y)
    return y, np.int64(a > _TOP) | np.int64(a != a)


@inline
def _ef_byte(r, g, at, end, by_sign):
    """The sign bits (1: ``y >= 0``) of ``y = r + g`` at ``at`` to ``at + 7`` (those below
    ``end``) packed in a byte, and there ``r = y - by_sign[bit]``: error feedback's new
    residual."""
    b = 0
    for j in range(8):
        i = at + j
        if i < end:
            y = r[i] + g[i]
            bit = np.int32(y >= 0)  # no branch on a sign: the signs are a coin toss
            b |= bit << j
            r[i] = y - by_sign[bit]
    return b


@parallel
def ef_sign_sums(r, g):
    """:func:`~.kernels_signs.sign_sums` of ``y = r + g`` (not stored), the same reduction,
    and how many ``y`` are not finite (then nothing may be kept)."""
    npos = 0
    spos = 0.0
    sneg = 0.0
    bad = 0
    for i in prange(r.shape[0]):
        y, odd = _ef_value(r, g, i)
        bad += odd
        x = np.float64(y)
        npos += x >= 0
        spos += max(x, 0.0)
        sneg += min(x, 0.0)
    return npos, spos, sneg, bad


@parallel
def ef_onebit_pack(r, g, pos, neg, out):
    """:func:`~.kernels_signs.onebit_pack` of ``y = r + g`` with ``subtract``: the sign
    bits of ``y`` and ``r = y - pos`` or ``y - neg``, in the same pass."""
    by_sign = np.asarray([neg, pos], np.float32)
    for q in prange(out.shape[0]):
        out[q] = _ef_byte(r, g, q * 8, r.shape[0], by_sign)


@parallel
def ef_count(r, g, t, chunks):
    """Top-k's first pass with error feedback: per stretch of ``y = r + g`` (float32, not
    stored; ``chunks`` stretches, fixed by the size), how many ``|y| >= t`` and how many
    ``y`` are not finite (int64 each; then nothing is touched)."""
    n = g.shape[0]
    size = (n + chunks - 1) // chunks
    counts = np.zeros(chunks, np.int64)
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        lo, hi = c * size, min(n, (c + 1) * size)
        rs, gs = r[lo:hi], g[lo:hi]  # (a slice's loop vectorises; one over lo..hi did not)
        got = 0
        odd = 0
        for i in range(hi - lo):
            y, o = _ef_value(rs, gs, i)
            got += np.int64(abs(y) >= t)
            odd += o
        counts[c] = got
        bad[c] = odd
    return counts, bad


_GATHER_BLOCK = 256  # values whose candidates are staged before they are copied out


@parallel
def ef_add_gather(r, g, t, starts, out, vals, chunks):
    """Top-k's second pass (after :func:`ef_count`): ``r = r + g`` written, and the
    positions (increasing) of ``|r| >= t`` and their values, each stretch's from
    ``starts[stretch]`` on into ``out`` and ``vals``.  Without a branch: every value is
    written to a small staging buffer, and its slot kept only where it passes."""
    n = g.shape[0]
    size = (n + chunks - 1) // chunks
    for c in prange(chunks):
        lo, hi = c * size, min(n, (c + 1) * size)
        rs, gs = r[lo:hi], g[lo:hi]
        at = starts[c]
        where = np.empty(_GATHER_BLOCK + 1, out.dtype)
        what = np.empty(_GATHER_BLOCK + 1, np.float32)
        for b in range(0, hi - lo, _GATHER_BLOCK):
            h = 0
            for i in range(b, min(hi - lo, b + _GATHER_BLOCK)):
                y = rs[i] + gs[i]
                rs[i] = y
                where[h] = lo + i
                what[h] = y
                h += np.int64(abs(y) >= t)
            out[at:at + h] = where[:h]
            vals[at:at + h] = what[:h]
            at += h


@parallel
def seg_sign_sums(r, g, starts, npos, spos, sneg):
    """Per segment of ``y = r + g`` (float32, not stored): the count of ``y >= 0`` and the
    float64 sums of ``max(y, 0)`` and ``min(y, 0)`` in index order (:func:`sign_sums`'s
    serial order); returns how many ``y`` are not finite, per segment (int64)."""
    count = starts.shape[0] - 1
    bad = np.zeros(count, np.int64)
    for s in prange(count):
        c = 0
        sp = 0.0
        sn = 0.0
        odd = 0
        for i in range(starts[s], starts[s + 1]):
            y, bad_i = _ef_value(r, g, i)
            odd += bad_i
            x = np.float64(y)
            c += x >= 0
            sp += max(x, 0.0)
            sn += min(x, 0.0)
        npos[s] = c
        spos[s] = sp
        sneg[s] = sn
        bad[s] = odd
    return bad


@parallel
def seg_onebit_pack(r, g, starts, pos, neg, out, offs):
    """Per segment: ``y = r + g``, its sign bits (1: ``y >= 0``) packed 8 a byte from
    ``out[offs[s]]`` on, and ``r = y - pos[s]`` or ``y - neg[s]`` (error feedback's
    residual, float32), as :func:`onebit_pack` does one chunk."""
    for s in prange(starts.shape[0] - 1):
        lo, hi = starts[s], starts[s + 1]
        by_sign = np.asarray([neg[s], pos[s]], np.float32)
        base = offs[s]
        for q in range((hi - lo + 7) // 8):
            out[base + q] = _ef_byte(r, g, lo + q * 8, hi, by_sign)


@parallel
def onebit_sum(buf, offs, tables, m, out):
    """The sum over payloads ``q`` (in order, float32) of ``tables[q, bit]``, bit ``i`` of
    the ``m`` packed from ``buf[offs[q]]`` on: an owner's chunk from its ``p`` senders, as
    decoding each and adding them in rank order gives."""
    p = offs.shape[0]
    for byte in prange((m + 7) // 8):
        for j in range(8):
            i = byte * 8 + j
            if i < m:
                acc = tables[0, (buf[offs[0] + byte] >> j) & 1]
                for q in range(1, p):
                    acc = acc + tables[q, (buf[offs[q] + byte] >> j) & 1]
                out[i] = acc


@parallel
def seg_onebit_decode(buf, offs, starts, tables, factor, scale, out):
    """Segment ``s`` of ``out``: ``tables[s, bit]`` of the bits packed from
    ``buf[offs[s]]`` on, times ``factor`` (float32) where ``scale``: every owner's chunk
    decoded (and averaged) into its place."""
    for s in prange(starts.shape[0] - 1):
        lo, hi = starts[s], starts[s + 1]
        base = offs[s]
        for i in range(lo, hi):
            k = i - lo
            v = tables[s, (buf[base + k // 8] >> (k % 8)) & 1]
            out[i] = v * factor if scale else v


@parallel
def seg_nonfinite(r, g, starts):
    """Per segment, how many ``y = r + g`` (float32, not stored) are not finite (int64):
    top-k's chunks are checked before any residual is touched."""
    count = starts.shape[0] - 1
    bad = np.zeros(count, np.int64)
    for s in prange(count):
        odd = 0
        for i in range(starts[s], starts[s + 1]):
            odd += _ef_value(r, g, i)[1]
        bad[s] = odd
    return bad


@inline
def _kth_largest(mags, k):
    """The ``k``-th largest of ``mags`` (non-negative float32, no NaN), read-only: a
    partition of the values in the histogram bin it falls in and above (the bit patterns
    of non-negative floats order as their values), or of all of them."""
    m = mags.shape[0]
    if m < _BINNED_FROM:
        return np.partition(mags, m - k)[m - k]
    bits = mags.view(np.uint32)
    hist = np.zeros(4096, np.int64)
    for j in range(m):
        hist[bits[j] >> 19] += 1
    b = 4095
    above = 0
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    c = above + hist[b]
    low = np.uint32(b) << np.uint32(19)
    cand = np.empty(c, np.float32)
    at = 0
    for j in range(m):
        if bits[j] >= low:
            cand[at] = mags[j]
            at += 1
    return np.partition(cand, c - k)[c - k]


@inline
def _top_indices(mags, k, idx):
    """The indices (increasing) of the ``k`` largest of ``mags`` (ties to the lower index:
    the core's :func:`~hvd_compress.core.sparsifiers.topk_indices` set) into ``idx``;
    returns how many (``k``: the k-th largest is exact)."""
    kth = _kth_largest(mags, k)
    above = 0
    for j in range(mags.shape[0]):
        above += mags[j] > kth
    ties = k - above  # the first values equal to the k-th largest, by index
    c = 0
    for j in range(mags.shape[0]):
        a = mags[j]
        take = a > kth
        if not take and a == kth and ties > 0:
            take = True
            ties -= 1
        if take and c < k:
            idx[c] = j
            c += 1
    return c


@parallel
def seg_topk_pack(r, g, starts, ks, out, offs):
    """Per segment: ``y = r + g``; its ``ks[s]`` largest ``|y|`` (ties to the lower index)
    as a top-k payload from ``out[offs[s]]`` on (int32 indices within the segment,
    increasing, then float32 values ``y``), and ``r = y`` with the chosen set to 0 (error
    feedback's residual: ``y + -y`` is +0).  Every ``y`` finite (:func:`seg_nonfinite`)."""
    for s in prange(starts.shape[0] - 1):
        lo, hi, k = starts[s], starts[s + 1], ks[s]
        mags = np.empty(hi - lo, np.float32)
        for i in range(lo, hi):
            y = r[i] + g[i]
            r[i] = y
            mags[i - lo] = abs(y)
        at = offs[s]
        idx = out[at:at + 4 * k].view(np.int32)
        val = out[at + 4 * k:at + 8 * k].view(np.float32)
        for q in range(_top_indices(mags, k, idx)):
            i = lo + idx[q]
            val[q] = r[i]
            r[i] = 0.0


@parallel
def topk_sum(buf, offs, k, out):
    """``out = 0``, then ``out[idx_q] += val_q`` for the top-k payloads ``q`` (``k`` each,
    from ``buf[offs[q]]`` on) in order (float32): an owner's chunk from its ``p``
    senders, as the first scattered into zeros and the others added in rank order.
    Returns how many indices fall outside ``out`` (those are skipped)."""
    m = out.shape[0]
    for i in prange(m):
        out[i] = 0.0
    bad = 0
    for q in range(offs.shape[0]):
        at = offs[q]
        idx = buf[at:at + 4 * k].view(np.int32)
        val = buf[at + 4 * k:at + 8 * k].view(np.float32)
        for j in range(k):
            i = idx[j]
            if i >= 0 and i < m:
                out[i] += val[j]
            else:
                bad += 1
    return bad


@parallel
def seg_topk_decode(buf, offs, starts, ks, factor, scale, out):
    """Segment ``s`` of ``out``: zeros, the top-k payload's ``ks[s]`` values (from
    ``buf[offs[s]]`` on) added at its indices, times ``factor`` (float32) where ``scale``:
    every owner's chunk decoded (and averaged) into its place.  Returns, per segment,
    how many indices fall outside it (those are skipped)."""
    count = starts.shape[0] - 1
    bad = np.zeros(count, np.int64)
    for s in prange(count):
        lo, hi, k = starts[s], starts[s + 1], ks[s]
        for i in range(lo, hi):
            out[i] = 0.0
        at = offs[s]
        idx = buf[at:at + 4 * k].view(np.int32)
        val = buf[at + 4 * k:at + 8 * k].view(np.float32)
        odd = 0
        for j in range(k):
            i = idx[j]
            if i >= 0 and i < hi - lo:
                out[lo + i] += val[j]
            else:
                odd += 1
        bad[s] = odd
        if scale:
            for i in range(lo, hi):
                out[i] = out[i] * factor
    return bad


@parallel
def seg_copy(src, src_at, sizes, dst, dst_at):
    """``dst[dst_at[s]:][:sizes[s]] = src[src_at[s]:][:sizes[s]]`` for every segment ``s``
    (bytes; the segments of ``dst`` do not overlap): a tensor's chunk payloads put into
    their ranks' rows of the alltoall's buffer."""
    for s in prange(sizes.shape[0]):
        a = src_at[s]
        b = dst_at[s]
        for i in range(sizes[s]):
            dst[b + i] = src[a + i]


@inline
def _dgc_mag(g, u, v, i, m, nesterov):
    """``|v|`` after DGC's momentum correction at ``i``, the chain's float32 arithmetic
    (:func:`~.kernels_select.dgc_sample`'s), nothing written."""
    if nesterov:
        x = (u[i] + g[i]) * m
        return abs((v[i] + x) + g[i])
    return abs(v[i] + (u[i] * m + g[i]))


@parallel
def seg_dgc_thresholds(g, u, v, pos, at, sizes, wants, m, nesterov, thr):
    """Per segment with ``sizes[s]`` > 0: DGC's sampled threshold before the correction
    loop, into ``thr[s]`` -- the ``wants[s]``-th largest of the new ``|v|`` at the
    segment's ``sizes[s]`` sampled positions ``pos[at[s]:]``
    (:func:`~.kernels_stochastic.seg_stratified`); nothing written to the state.  Returns,
    per segment, how many sampled magnitudes are not finite."""
    count = sizes.shape[0]
    bad = np.zeros(count, np.int64)
    for s in prange(count):
        k = sizes[s]
        if k == 0:
            continue
        sample = np.empty(k, np.float32)
        odd = 0
        for j in range(k):
            a = _dgc_mag(g, u, v, pos[at[s] + j], m, nesterov)
            sample[j] = a
            odd += np.int64(not (a <= _TOP))
        bad[s] = odd
        if odd == 0:
            thr[s] = _kth_largest(sample, wants[s])
    return bad


@parallel
def seg_dgc_pack(g, u, v, starts, ks, lowered, sampled, m, nesterov, masking, out, offs):
    """Per segment: DGC's momentum correction in place (``u = u*m + g; v = v + u``;
    Nesterov ``u = (u + g)*m; v = (v + u) + g``); where ``sampled[s]``, the correction
    loop over the thresholds ``lowered[s]`` (the sampled one, then each lowering: the first
    that at least ``0.8 k`` pass, else the last) -- where at least ``k`` pass, the ``k``
    largest ``|v|`` (ties to the lower index), else all that pass; not sampled, the ``k``
    largest.  The payload from ``out[offs[s]]`` on: int32 indices within the segment,
    increasing, then the float32 values ``v`` (unused slots 0, 0); ``v`` then 0 where sent,
    and with ``masking`` ``u`` too (``x - x``, as the chain's ``x + -x``, where selected
    exactly: NaN where an overflow made ``x`` infinite).  Returns, per segment, how many new ``u`` or ``v``
    are not finite."""
    count = starts.shape[0] - 1
    bad = np.zeros(count, np.int64)
    for s in prange(count):
        lo, hi, k = starts[s], starts[s + 1], ks[s]
        n = hi - lo
        mags = np.empty(n, np.float32)
        odd = 0
        for i in range(lo, hi):
            if nesterov:
                x = (u[i] + g[i]) * m
                y = (v[i] + x) + g[i]
            else:
                x = u[i] * m + g[i]
                y = v[i] + x
            u[i] = x
            v[i] = y
            a = abs(y)
            mags[i - lo] = a
            odd += np.int64(not (a <= _TOP)) + np.int64(not (abs(x) <= _TOP))
        bad[s] = odd
        passed = k
        t = np.float32(0.0)
        if sampled[s]:
            rounds = lowered.shape[1] - 1
            r = 0
            while True:
                t = lowered[s, r]
                passed = 0
                for j in range(n):
                    passed += mags[j] >= t
                if r == rounds or passed >= 0.8 * k:
                    break
                r += 1
        at = offs[s]
        idx = out[at:at + 4 * k].view(np.int32)
        val = out[at + 4 * k:at + 8 * k].view(np.float32)
        c = 0
        if passed >= k:  # the k largest (all of them pass where some threshold did)
            c = _top_indices(mags, k, idx)
        else:
            for j in range(n):
                if mags[j] >= t:
                    idx[c] = j
                    c += 1
        for q in range(c):  # (exact: the chain's v + -v and u + -u; sampled: host_select's 0)
            i = lo + idx[q]
            y = v[i]
            val[q] = y
            v[i] = y - y if not sampled[s] else np.float32(0.0)
            if masking:
                u[i] = u[i] - u[i] if not sampled[s] else np.float32(0.0)
        for q in range(c, k):
            idx[q] = 0
            val[q] = 0.0
    return bad
