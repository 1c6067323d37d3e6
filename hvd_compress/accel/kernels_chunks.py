"""numba kernels of the two-phase exchange's chunks, all of a tensor's in one call (the
wrappers: :mod:`.host_chunks`).

The two-phase exchange (:mod:`hvd_compress.core.twophase`) cuts each tensor into ``p``
chunks; encoded one call each, a tensor costs ``p + 1`` encodes and ``2 p`` decodes, and
at 1,024 workers the calls' fixed cost (Python, dispatch: 0.1-0.6 ms each) outweighs their
values.  These kernels take every chunk of a tensor at once: segment ``s`` is
``[starts[s], starts[s+1])``, each summed and packed in index order by one thread, as
the serial kernels of :mod:`.kernels_signs` do one chunk (so their bits).  Payloads are
read and written at byte offsets in one buffer (a received row, an allgather's table).
"""

import numpy as np

from .jit import parallel, prange

_TOP = np.float32(3.4028234663852886e38)


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
            y = r[i] + g[i]
            a = abs(y)
            odd += np.int64(a > _TOP) | np.int64(a != a)
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
            b = 0
            for j in range(8):
                i = lo + q * 8 + j
                if i < hi:
                    y = r[i] + g[i]
                    bit = np.int32(y >= 0)
                    b |= bit << j
                    r[i] = y - by_sign[bit]
            out[base + q] = b


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
