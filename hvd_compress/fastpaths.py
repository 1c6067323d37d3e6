"""The host backends' fast paths: the numba kernels of :mod:`hvd_compress.kernels` behind
the core's one hook, ``B.fused_encoder(codec, cols)``.

The core (:mod:`hvd_compress.core`) holds only the reference chains and never
imports this module or numba.  Importing :mod:`hvd_compress` installs
:func:`host_encoder` in the core's provider slot
(:func:`hvd_compress.core.backend.set_host_fast_paths`); the numpy backend, and
the torch backend for CPU tensors, then answer ``fused_encoder`` from it.
numba is imported, and the kernels loaded from its cache, on the first
encoder asked for -- not when the package is imported.

Each encoder keeps the contract of ``NumpyBackend.fused_encoder`` with a
Python bool for ``finite``: the step starts as the core's host path does
(:func:`~hvd_compress.core.base.ef_sum_host`: finiteness, ``residual += g`` in
place, overflow counted as non-finite and undone); on NaN/Inf it returns at
once (no noise drawn) and the core runs its reference non-finite step.  TernGrad and
QSGD, when the noise is not given, hash each element's index under one 64-bit key
drawn per step from the compressor's generator (the values TensorFlow's compiled
ops draw for the same key) instead of drawing ``n`` values, which alone took a third
of QSGD's step; the stream differs from the chain's, both uniform, and explicit noise
gives the chain's bits.  Without error feedback their statistics pass also tells
finiteness.  The scales come from the codec's own helpers (the reference
arithmetic); the kernels do the per-element passes -- sums, codes, bit packing and, for 1-bit
and threshold, the residual update -- with the same bits
(``tests/test_kernels.py``); 1-bit by columns (``cols`` > 1) sums each column down
the rows as numpy does.  ``HVD_COMPRESS_FUSED=0`` turns every fast path off.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import numpy as np

from .core.backend import NUMPY, prime_stride, set_host_fast_paths
from .core.base import ef_sum_host
from .core.bitpack import pack_codes, packed_nbytes
from .core.sparsifiers import index_dtype

__all__ = ["requested", "host_encoder"]


def requested() -> bool:
    """Whether fast paths may run at all: ``HVD_COMPRESS_FUSED=0`` turns off the numba
    kernels and the TensorFlow ops of :mod:`hvd_compress.tensorflow.fused_ops`."""
    return os.environ.get("HVD_COMPRESS_FUSED", "1") != "0"


_KERNELS = None  # hvd_compress.kernels once loaded, False without numba


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from . import kernels  # imports numba (kernels compiled once, then cached on disk)
        _KERNELS = kernels if kernels.AVAILABLE else False
    return _KERNELS


def host_encoder(B, codec, cols: int):
    """A host backend's fused encoder for ``codec`` (see the module), or None: turned
    off, numba missing, or a codec without kernels."""
    body = _BODIES.get(codec.name)
    own = ("signum", "dgc", "stratified", "intsum", *_STEPS)  # encoders of their own signature
    if (body is None and codec.name not in own) or (codec.name == "inceptionn" and codec.ef) \
            or not requested():
        return None
    k = _kernels()
    if not k:
        return None
    if codec.name == "signum":  # its state is the momentum, not an error-feedback residual
        return lambda g, momentum, noise, noise_source: _signum(k, B, codec, g, momentum)
    if codec.name == "dgc":  # its state is u and v (see DGC._encode_fused)
        return lambda g, st, meta, _: _dgc(k, B, codec, g, st, meta)
    if codec.name == "stratified":  # core.sampling's indices (random-k's, DGC's sample)
        return lambda n, kk, key0, key1: _stratified(k, B, n, kk, key0, key1)
    if codec.name == "intsum":  # integer sums' passes (see IntSumHost)
        return IntSumHost(k, B)

    if codec.name == "onebit" and cols != 1:
        body = functools.partial(_onebit, cols=cols)
    smallest = _SMALLEST.get(codec.name, 0)
    step = _STEPS.get(codec.name)

    def encode(g, residual, noise, noise_source):
        if B.shape(g)[0] < smallest:
            return None  # declined for this tensor (nothing touched): the chain
        if step is not None:
            return step(k, B, codec, g, residual, noise, noise_source)
        v, finite = ef_sum_host(B, g, residual)
        if not finite:
            return None, residual, False
        n = B.shape(v)[0]
        if getattr(codec, "needs_noise", False) and noise is None:
            noise = noise_source.draw(n, like=g)
        fields = body(k, B, codec, v, noise, residual is not None)
        return fields, (v if residual is not None else None), True
    return encode


def _stratified(k, B, n, kk, key0, key1):
    """:func:`~hvd_compress.core.sampling.stratified_indices`'s indices and sizes from
    one kernel (the chain makes about twenty passes of integer operations)."""
    indices, sizes = np.empty(kk, np.int64), np.empty(kk, np.int64)
    k.stratified(np.int64(n), np.int64(kk), np.uint64(int(B.to_numpy(key0))),
                 np.uint64(int(B.to_numpy(key1))), indices, sizes)
    return B.from_host(indices), B.from_host(sizes)


def _codes(n, bits):
    """A fresh numpy buffer for ``n`` packed ``bits``-bit codes."""
    return np.empty(packed_nbytes(n, bits), np.uint8)


def _subtract_decoded(B, codec, v, fields):
    """``v -= decoded`` (error feedback) for codecs whose kernel does not do it."""
    B.isub(v, codec.decode_values(B, fields, B.shape(v)[0]))


def _threshold(k, B, codec, v, noise, ef):
    tau = codec.tau
    out = _codes(B.shape(v)[0], 2)
    k.threshold_pack(B.host_view(v), np.float32(tau), out, ef)  # with ef: v -= sent
    return {"scale": B.asarray([tau], "float32", like=v), "codes": B.from_host(out)}


def _onebit(k, B, codec, v, noise, ef, cols=1):
    n = B.shape(v)[0]
    vh = B.host_view(v)
    if cols == 1:
        npos, spos, sneg = (np.asarray(t) for t in k.sign_sums(vh))  # one pass
        npos = npos.astype(np.int64)
    else:  # by columns: one pass down the rows, the reference's sums and order
        npos, total, spos = np.empty(cols, np.int64), np.empty(cols), np.empty(cols)
        k.column_sign_sums(vh.reshape(-1, cols), npos, total, spos)
        sneg = total - spos  # as the reference derives it
    npos, spos, sneg = (B.from_host(t) for t in (npos, spos, sneg))
    pos, neg = codec.means(B, npos, spos, sneg, n // cols, cols)
    out = _codes(n, 1)
    if cols == 1:
        k.onebit_pack(vh, np.float32(B.to_numpy(pos)[0]), np.float32(B.to_numpy(neg)[0]), out,
                      ef)  # with ef: v -= pos or neg
    else:
        k.onebit_pack_columns(vh, B.host_view(neg), B.host_view(pos), out, ef)
    return {"pos": pos, "neg": neg, "signs": B.from_host(out)}


def _noise_args(B, v, noise, noise_source=None, key=None):
    """A kernel's noise arguments: the given noise and a zero key, or no noise and the
    halves of one 64-bit key (``key``, else drawn from ``noise_source``, the
    compressor's generator; the kernel hashes each element's index under it:
    ``kernels._fill_uniform``)."""
    if noise is not None:
        return B.host_view(noise), np.uint64(0), np.uint64(0)
    if key is None:
        key = noise_source.key(like=v) if noise_source is not None else 0
    return _NO_NOISE, np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)


_NO_NOISE = np.empty(0, np.float32)


def _terngrad_scale(k, B, codec, v):
    """``(scale, cap)``: TernGrad's scale ``max|clip(v)|`` and clipping cap from one pass
    (sums and max |v|), or None where ``v`` is not finite."""
    n, c = B.shape(v)[0], codec.clip
    s1, s2, top = k.moments(B.host_view(v))
    if not (np.isfinite(s1) and np.isfinite(s2)):
        return None
    # the chain's max(min(|v|, cap)) is min(max|v|, cap)
    if c > 0:
        s1, s2 = (B.from_host(np.asarray(t)) for t in (s1, s2))
        cap = np.float32(c * B.to_numpy(codec.sigma(B, s1, s2, n)))
    else:
        cap = np.float32(np.inf)
    return np.minimum(np.float32(top), cap), cap


def _qsgd_scales(k, B, codec, v):
    """``(norms, inv)``: QSGD's bucket norms and ``s / norm`` from one pass (float64 sums of
    squares, non-finite exactly where a value is), or None where ``v`` is not finite."""
    sumsq = k.bucket_sumsq(B.host_view(v), codec.d)
    if not np.isfinite(sumsq).all():
        return None
    return codec.scales(B, v, B.from_host(sumsq))


def _terngrad(k, B, codec, v, noise, noise_source):
    """TernGrad's fields, or None where ``v`` is not finite (nothing drawn): its sums and
    max |v| in one pass, then the codes with the noise given or hashed."""
    got = _terngrad_scale(k, B, codec, v)
    if got is None:
        return None
    scale, cap = got
    n, vh = B.shape(v)[0], B.host_view(v)
    out = _codes(n, 2)
    k.terngrad_pack(vh, *_noise_args(B, v, noise, noise_source), cap,
                    np.float32(scale if scale > 0 else 1.0), out)
    return {"scale": B.asarray([scale], "float32", like=v), "codes": B.from_host(out)}


def _qsgd(k, B, codec, v, noise, noise_source):
    """QSGD's fields, or None where ``v`` is not finite (nothing drawn): the buckets'
    float64 sums of squares in one pass (non-finite exactly where a value is), then the
    codes with the noise given or hashed."""
    n, packed = B.shape(v)[0], codec.bits == 4
    vh = B.host_view(v)
    got = _qsgd_scales(k, B, codec, v)
    if got is None:
        return None
    norms, inv = got
    out = _codes(n, 4) if packed else np.empty(n, np.uint8)  # 4-bit codes: packed by the kernel
    k.qsgd_codes(vh, B.host_view(B.cast(inv, "float32")), *_noise_args(B, v, noise, noise_source),
                 codec.s, codec.d, packed, out)
    codes = B.from_host(out)
    return {"norms": norms, "codes": codes if packed else pack_codes(B, codes, codec.bits)}


def _stats_step(fields_of):
    """A whole step for a codec whose statistics pass also tells finiteness (its sums
    are non-finite exactly where a value is): without error feedback no separate
    check; with it the core's host start (:func:`ef_sum_host`), then the fields and
    ``v -= decoded``."""
    def step(k, B, codec, g, residual, noise, noise_source):
        if residual is None:
            fields = fields_of(k, B, codec, g, noise, noise_source)
            return (None, None, False) if fields is None else (fields, None, True)
        v, finite = ef_sum_host(B, g, residual)
        if not finite:
            return None, residual, False
        fields = fields_of(k, B, codec, v, noise, noise_source)
        _subtract_decoded(B, codec, v, fields)
        return fields, v, True
    return step


def _sign(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    vh = B.host_view(v)
    # the chain's float64 L1 sum divided by n, rounded to float32 (1 for signSGD)
    scale = np.float32(k.abs_sum(vh) / n) if codec.scaled else \
        np.float32(B.to_numpy(B.absmax(v)) > 0)  # 0 for an all-zero tensor, as the chain
    out = _codes(n, 1)
    k.onebit_pack(vh, scale, -scale, out, ef)  # with ef: v -= +-scale
    return {"scale": B.asarray([scale], "float32", like=v), "signs": B.from_host(out)}


def _signum(k, B, codec, g, momentum):
    """Signum's step in one pass: the new momentum (a fresh buffer: the old one stays
    if the step is not finite), its sign bits, and whether it is finite and nonzero."""
    n = B.shape(g)[0]
    fresh, signs = np.empty(n, np.float32), _codes(n, 1)
    finite, nonzero = k.signum_step(B.host_view(momentum), B.host_view(g), np.float32(codec.beta),
                                    np.float32(1.0 - codec.beta), fresh, signs)
    if not finite:
        return None, momentum, False
    fields = {"scale": B.asarray([1.0 if nonzero else 0.0], "float32", like=g),
              "signs": B.from_host(signs)}
    return fields, B.from_host(fresh), True


def _natural(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    exps, signs = np.empty(n, np.uint8), _codes(n, 1)
    k.natural_codes(B.host_view(v), B.host_view(noise), codec.powers, exps, signs, ef)
    return {"exps": B.from_host(exps), "signs": B.from_host(signs)}


def _uniform(k, B, codec, v, noise, ef):
    n, bits, d = B.shape(v)[0], codec.bits, codec.d
    vh = B.host_view(v)
    lo, hi = (B.from_host(t) for t in k.bucket_minmax(vh, d))
    scale, inv = codec.scales(B, lo, hi)
    pack = bits if 8 % bits == 0 else 8  # other widths: one code a byte, packed after
    out = _codes(n, pack)
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


_CHUNKS_SELECT = 16  # fixed stretches (the same bits for any thread count), at most


_NO_HIGH = np.zeros(0, np.int64)  # top_counts of the top 16 bits


def _select_chunks(n):
    """Stretches for the selection kernels: up to 16 (fixed by ``n``, so the bits do
    not depend on the threads), fewer for small tensors (smaller counts to clear)."""
    return min(_CHUNKS_SELECT, max(1, n >> 16))


def _top_by_bits(k, vh, count, by_sign, itype):
    """The ``ks[g]`` largest magnitudes of each group of ``vh`` (by sign: 0 positive, 1
    negative, zeros in neither; else one group of every value), ``ks = count(sizes of
    the groups)``; their indices increasing, ties to the lower index, as one ``itype``
    array (group 0's, then group 1's).  Returns ``(indices, ks)``.

    Two counts of the float32 bit patterns of ``|v|`` (the top 16 bits, then the low
    16 bits within the boundary pattern) find each group's cut exactly, and a third
    pass writes the indices, each stretch of ``vh`` from its own offset: no sort."""
    n = vh.shape[0]
    chunks = _select_chunks(n)
    high = k.top_counts(vh, _NO_HIGH, chunks, by_sign)
    per_group = high.sum(axis=0, dtype=np.int64)
    ks = [int(c) for c in count([int(t) for t in per_group.sum(axis=1)])]
    top = np.full(2, -1, np.int64)  # the boundary's top 16 bits, per group
    need = [0, 0]  # how many to take within it
    for g, kk in enumerate(ks):
        if kk:
            at_least = np.cumsum(per_group[g][::-1])[::-1]  # values in patterns >= each
            top[g] = np.flatnonzero(at_least >= kk)[-1]
            need[g] = kk - (at_least[top[g]] - per_group[g][top[g]])
    low = k.top_counts(vh, top, chunks, by_sign)
    cut = np.full(2, 1 << 31, np.int64)  # above every pattern: nothing of an empty group
    ties, starts = np.zeros((chunks, 2), np.int64), np.zeros((chunks, 2), np.int64)
    for g, kk in enumerate(ks):
        if not kk:
            continue
        lows = low[:, g].sum(axis=0, dtype=np.int64)
        at_least = np.cumsum(lows[::-1])[::-1]
        b = np.flatnonzero(at_least >= need[g])[-1]
        cut[g] = (int(top[g]) << 16) | int(b)
        take = need[g] - (at_least[b] - lows[b])  # values equal to the cut
        equal = low[:, g, b].astype(np.int64)
        ties[:, g] = np.clip(take - (np.cumsum(equal) - equal), 0, equal)  # the first ones
        above = high[:, g, top[g] + 1:].sum(axis=1, dtype=np.int64) + \
            low[:, g, b + 1:].sum(axis=1, dtype=np.int64)
        taken = above + ties[:, g]
        starts[:, g] = np.cumsum(taken) - taken
    out = np.empty(ks[0] + ks[1], itype)
    k.top_select(vh, cut, ties, starts, out[:ks[0]], out[ks[0]:], chunks, by_sign)
    return out, ks


def _adaq(k, B, comp, v, noise, ef):
    """Adaptive quantization's payload (``comp``: the compressor): per sign, the k
    largest magnitudes (:func:`_top_by_bits`), the means from the compressor's own
    ``mean``.  With ``ef``, ``v`` keeps the residual."""
    vh = B.host_view(v)
    itype = index_dtype(vh.shape[0])
    idx, ks = _top_by_bits(k, vh, lambda sizes: [comp.count(m) for m in sizes], True, itype)
    pos, neg = idx[:ks[0]], idx[ks[0]:]
    means = [B.to_numpy(comp.mean(v, B.from_host(i), kk)) for i, kk in ((pos, ks[0]), (neg, ks[1]))]
    head = np.asarray([1.0, means[0], means[1], 0.0], np.float32)
    head[3:].view(np.int32)[0] = ks[0]
    if ef:  # as the chain: v[i] + (-mean)
        for i, m in ((pos, means[0]), (neg, means[1])):
            vh[i] += -np.float32(m)
    return {"payload": B.from_host(np.concatenate([head.view(np.uint8), idx.view(np.uint8)]))}


def _topk(k, B, comp, g, residual, noise, noise_source):
    """Top-k's whole step and payload (indices, then values): the k largest magnitudes,
    ties to the lower index, and their values.  A cut a little below the k-th largest
    is read from a strided sample of ``|g + residual|`` (:func:`_sample_cut`); the
    pass that adds ``g`` into the residual (without error feedback: a read of ``g``)
    counts the values at or above it and the non-finite ones; one more pass gathers
    those at or above it, and the k largest of them are the top-k
    (:func:`_k_largest`).  Where fewer than k pass, or far more, the top-k comes from
    :func:`_top_by_bits`.  Non-finite: ``g`` is checked before the sum, an overflow of
    the sum undone as the core's host path does (:func:`ef_sum_host`).  The values
    sent leave the residual (0, as the chain's ``v + -v``)."""
    gh = B.host_view(g)
    n, ef = gh.shape[0], residual is not None
    kk, itype, chunks = comp.k_for(comp.meta_for(g)), index_dtype(n), _select_chunks(n)
    if ef and not bool(B.all_finite(g)):
        return None, residual, False
    vh = B.host_view(residual) if ef else gh
    t = _sample_cut(gh, vh if ef else None, kk)
    counts, bad = k.add_count(vh, gh, t, ef, chunks)
    if bad.any():
        if ef:  # float32 overflow of the sum: undone, a non-finite step
            B.isub(residual, g)
        return None, residual, False
    passed = int(counts.sum())
    if kk <= passed <= _most_gathered(n, kk):
        cand, vals = _gather_pass(k, vh, t, counts, itype)
        keep = _k_largest(vals, kk)
        idx, values = cand[keep], vals[keep]
    else:
        idx, _ = _top_by_bits(k, vh, lambda sizes: [kk, 0], False, itype)
        values = vh[idx]
    if ef:
        vh[idx] = 0.0
    payload = B.from_host(np.concatenate([idx.view(np.uint8), values.view(np.uint8)]))
    return {"payload": payload}, residual, True


_FAR_MORE = 8  # more than this many times k passing (and _GATHER_LEAST): top-k by bit patterns
_GATHER_LEAST = 1 << 16  # candidates always gathered (bit-pattern counts cost more below)


def _most_gathered(n, kk):
    """The most candidates a selection gathers and picks the k largest of; beyond, the
    top-k comes from the bit-pattern counts (:func:`_top_by_bits`), whose fixed cost
    is what a small tensor's handful of candidates would not repay."""
    return min(n, max(_FAR_MORE * kk, _GATHER_LEAST))


def _room(n, kk, chunks):
    """Candidates a stretch of a fused pass may gather (its slots in the buffers:
    untouched pages of them cost nothing)."""
    return min(-(-n // chunks), _most_gathered(n, kk))


def _gather_pass(k, vh, t, counts, itype):
    """The indices of the values ``|v| >= t`` (``counts`` per stretch), in index order,
    and those values, by one pass (:func:`~hvd_compress.kernels.at_least`)."""
    cand, vals = np.empty(int(counts.sum()), itype), np.empty(int(counts.sum()), np.float32)
    k.at_least(vh, np.float32(t), np.cumsum(counts) - counts, cand, vals, counts.shape[0])
    return cand, vals


_SAMPLE_HITS = 200  # sampled values expected above the k-th largest (the cut's resolution)


def _sample_cut(gh, rh, kk):
    """A magnitude a little below the k-th largest of ``|g + r|`` (``r`` None: of
    ``|g|``), from every ``stride``-th value (a prime): the sample's value of rank ``e + 3
    sqrt(e) + 1``, ``e`` the sampled values expected above the k-th largest, so that at
    least k, and about 1.2 k, pass.  Only the speed depends on it, never the result;
    +Inf where a sample would be most of the tensor (then the bit-pattern top-k)."""
    n = gh.shape[0]
    stride = max(1, n // max(1, -(-_SAMPLE_HITS * n // kk)))
    if stride < 4:
        return np.float32(np.inf)
    stride = prime_stride(stride)  # (a matrix's rows never line up with it)
    sample = np.abs(gh[::stride] + rh[::stride]) if rh is not None else np.abs(gh[::stride])
    s = sample.shape[0]
    e = kk * s / n
    rank = min(s, int(e + 3 * np.sqrt(e)) + 1)
    return np.float32(np.partition(sample, s - rank)[s - rank])


def _k_largest(vals, kk):
    """Which of the candidates' values ``vals`` (in index order; at least ``kk``) are
    the ``kk`` largest magnitudes, ties to the lower index: a mask, without a sort."""
    mags = np.abs(vals)
    m = mags.shape[0]
    kth = np.partition(mags, m - kk)[m - kk]
    keep = mags > kth
    equal = np.flatnonzero(mags == kth)[:kk - int(np.count_nonzero(keep))]
    keep[equal] = True
    return keep


def _dgc(k, B, comp, g, st, meta):
    """DGC's step for a sampled tensor (see ``DGC._encode_fused``).  The compressor's own
    sampled threshold (:meth:`DGC.sample_threshold`) is taken before the update, on the
    sampled positions' new ``|v|`` computed there with the update's float32 arithmetic;
    the momentum correction's one pass then counts the values at or above it and
    above its first lowering (the float32 product :meth:`DGC.lowered` computes), which
    answers the correction loop almost always (a deeper lowering costs one read pass
    each), and gathers those at or above it block by block while the block is in
    cache (after a lowering, one more pass gathers).  Where at least k pass, the k
    largest of those that pass are the top-k (the chain takes the k largest of its
    candidates); else every value that passes, in index order.  When far more than
    k pass (:func:`_most_gathered`), the top-k comes from :func:`_top_by_bits`.  The
    sent values leave ``v`` and, with masking, ``u``.  Returns the payload and the
    selection (indices, valid slots, values sent), or None (NaN/Inf in ``g``: nothing
    touched, the chain runs)."""
    if not ef_sum_host(B, g, None)[1]:
        return None
    gh, uh, vh = B.host_view(g), B.host_view(st["u"]), B.host_view(st["v"])
    n, kk = vh.shape[0], comp.k_for(meta)
    m, nesterov = np.float32(comp.params["momentum"]), bool(comp.params["nesterov"])

    def new_mag(pos):  # the sampled positions' |v| after the update, as the kernel makes it
        return B.from_host(k.dgc_sample(gh, uh, vh, B.host_view(pos), m, nesterov))

    thr = comp.sample_threshold(new_mag, meta, st["step"], like=g)
    tried = []  # the loop's thresholds: thr, then each lowering (a count of 0 lowers)
    last = comp.lowered(thr, kk, lambda t: tried.append(t) or 0)
    ts = np.asarray([np.float32(B.to_numpy(t)) for t in tried + [last]], np.float32)
    if not np.isfinite(ts).all():  # an Inf/NaN momentum sampled: the chain (nothing touched)
        return None
    chunks, itype = _select_chunks(n), index_dtype(n)
    room = _room(n, kk, chunks)
    cand, vals = np.empty(room * chunks, itype), np.empty(room * chunks, np.float32)
    counts = k.dgc_momentum(gh, uh, vh, m, nesterov, ts[0], ts[1], chunks, cand, vals, room)
    per = dict(zip(ts[:2].tolist(), counts[:, :2].T))

    def per_chunk(t):  # how many |v| >= t, per stretch: counted in the pass, or one more
        t = float(t if isinstance(t, np.float32) else np.float32(B.to_numpy(t)))
        if t not in per:
            per[t] = k.count_at_least(vh, np.float32(t), chunks)
        return per[t]

    t = np.float32(B.to_numpy(comp.lowered(thr, kk, lambda t: int(per_chunk(t).sum()))))
    passed = int(per_chunk(t).sum())
    if passed > _most_gathered(n, kk):  # the top-k from the bit-pattern counts
        idx, _ = _top_by_bits(k, vh, lambda sizes: [kk, 0], False, itype)
    else:
        if t == ts[0] and (counts[:, 2] >= 0).all():  # gathered in the pass: each stretch's slots
            parts = [slice(c * room, c * room + int(counts[c, 2])) for c in range(chunks)]
            idx, vals = np.concatenate([cand[p] for p in parts]), np.concatenate([vals[p] for p in parts])
        else:  # the loop lowered the threshold: one more pass
            idx, vals = _gather_pass(k, vh, t, per_chunk(t), itype)
        if passed >= kk:  # the k largest of them, ties to the lower index
            idx = idx[_k_largest(vals, kk)]
    got = idx.shape[0]
    indices, values = np.zeros(kk, itype), np.zeros(kk, np.float32)
    indices[:got] = idx
    values[:got] = vh[idx]
    vh[idx] = 0.0  # v keeps what was not sent (v + -v = +0)
    if comp.params["masking"]:
        uh[idx] = 0.0
    payload = np.concatenate([indices.view(np.uint8), values.view(np.uint8)])
    valid = np.arange(kk) < got
    return (B.from_host(payload), B.from_host(indices.astype(np.int64)), B.from_host(valid),
            B.from_host(values), None)  # None: u and v updated in place



def _inceptionn(k, B, comp, v, noise, ef):
    """INCEPTIONN's payload: the width codes and per-stretch counts in one pass, the
    values by width in another (into spare-slotted buffers, then the payload)."""
    vh = B.host_view(v)
    n, chunks = vh.shape[0], _CHUNKS_SELECT
    inv = 1.0 / comp.step
    codes = _codes(n, 2)
    counts = k.inceptionn_widths(vh, inv, codes, chunks)
    n32, n16, n8 = (int(c) for c in counts.sum(axis=0))
    starts = np.cumsum(counts, axis=0) - counts
    wide = np.empty(n32 + 16 * chunks, np.float32)
    mid = np.empty(n16 + 32 * chunks, np.int16)
    low = np.empty(n8 + 64 * chunks, np.uint8)
    k.inceptionn_pack(vh, inv, starts, starts + counts, wide, mid, low, chunks)
    head = np.asarray([1.0], np.float32).view(np.uint8), np.asarray([n32, n16], np.int32).view(np.uint8)
    payload = np.concatenate(head + (wide[:n32].view(np.uint8), mid[:n16].view(np.uint8), low[:n8], codes))
    return {"payload": B.from_host(payload)}


# the fewest elements a whole-payload fast path takes (adaq's counts cost more than
# the chain's selection on smaller tensors)
_SMALLEST = {"adaq": 1 << 16, "topk": 1 << 16}

_BODIES = {"threshold": _threshold, "onebit": _onebit,
           "signsgd": _sign, "efsignsgd": _sign, "natural": _natural, "uniform": _uniform,
           "eightbit": _eightbit, "sketchml": _sketchml, "adaq": _adaq,
           "inceptionn": _inceptionn}

# whole steps (g, residual, noise, noise_source -> fields, residual, finite) for codecs
# whose first pass does more than the core's host start
_STEPS = {"terngrad": _stats_step(_terngrad), "qsgd": _stats_step(_qsgd), "topk": _topk}


class IntSumHost:
    """The host passes of :class:`~hvd_compress.core.intsum.IntegerSum` (without error
    feedback): round 0's scales from one statistics pass that also tells finiteness
    (TernGrad's moments, QSGD's bucket sums of squares), round 1's codes straight into
    int32 lanes, and the lane sums decoded -- one pass each, the chain's bits for the same
    noise (without noise given, each element's index hashed under a key drawn at round 0,
    as the quantizers' kernels do)."""

    KINDS = {"terngrad": 0, "qsgd": 1, "signsgd": 2}

    def __init__(self, k, B):
        self.k, self.B = k, B

    def scales(self, comp, v):
        """``(scales, cap)``: this rank's float32 scales and TernGrad's clipping cap (else
        None), or None where ``v`` is not finite (then the chain runs)."""
        k, B = self.k, self.B
        if comp.kind == "terngrad":
            got = _terngrad_scale(k, B, comp.codec, v)
            return None if got is None else (B.asarray([got[0]], "float32", like=v), got[1])
        if comp.kind == "qsgd":
            got = _qsgd_scales(k, B, comp.codec, v)
            return None if got is None else (got[0], None)
        if not bool(B.all_finite(v)):
            return None
        return B.zeros((1,), "float32", like=v), None

    def words(self, comp, v, noise, key, shared, cap, nwords: int, bias: int):
        """Round 1's int32 words against the ``shared`` scales."""
        B = self.B
        sh = B.host_view(shared)
        inv = np.zeros(1, np.float32)
        safe = np.float32(1.0)
        if comp.kind == "terngrad":
            safe = sh[0] if sh[0] > 0 else np.float32(1.0)
        elif comp.kind == "qsgd":
            inv = B.host_view(B.cast(comp.codec.inverse(B, shared), "float32"))
        args = _noise_args(B, v, noise, key=key)  # (signSGD: no noise, no key; unused)
        out = np.empty(nwords, np.int32)
        d = comp.codec.d if comp.kind == "qsgd" else 1
        self.k.intsum_words(B.host_view(v), *args, self.KINDS[comp.kind],
                            np.float32(np.inf if cap is None else cap), np.float32(safe), inv,
                            d, comp.m, comp.w, np.int64(bias & 0xFFFFFFFF), out)
        return B.from_host(out)

    def lanes(self, comp, words, n: int, unit, bias: int, out=None):
        """The decoded sum (float32[n]) of summed ``words``, into ``out`` where given."""
        B = self.B
        if out is None:
            out = np.empty(n, np.float32)
        u = _NO_UNIT if unit is None else B.host_view(B.cast(unit, "float32"))
        d = comp.codec.d if comp.kind == "qsgd" else max(n, 1)
        self.k.intsum_lanes(B.host_view(words), n, comp.w, np.int64(bias & 0xFFFFFFFF), u, d,
                            comp.vote, out)
        return out


_NO_UNIT = np.empty(0, np.float32)


def host_decoder(B, codec, cols: int):
    """A host backend's fused decoder for ``codec`` -- ``(fields, n) -> float32[n]``, the
    chain's bits -- or None: turned off, numba missing, or a codec without one."""
    body = _DECODERS.get(codec.name)
    if body is None or not requested() or (codec.name in ("uniform", "qsgd") and 8 % codec.bits):
        return None
    if codec.name == "onebit" and cols != 1:
        body = _onebit_columns_decode
    k = _kernels()
    if not k:
        return None

    def decode(fields, n):
        out = _RESULTS.take(n)
        if body(k, B, codec, {key: B.host_view(a) for key, a in fields.items()}, out) is False:
            return None  # declined for this payload: the chain
        return B.from_host(out)
    return decode


class _ResultBuffers:
    """Big decoded results (float32, 1 MiB and more) in buffers reused once nothing holds
    them -- no array, view or tensor over them (CPython's reference count says so) -- as
    the TensorFlow ops' buffer cache: a fresh 100 MB buffer is fresh pages, whose first
    touches cost about a copy and, where numpy has asked the kernel for huge pages, at
    times waited on its compaction (60-125 ms a decode seen here).  At most 1 GiB is
    kept (the oldest let go first).  Every decoder writes all of its result."""

    SMALLEST = 1 << 20
    HELD = 1 << 30

    def __init__(self):
        self._kept = []  # oldest first
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        if 4 * n < self.SMALLEST:
            return np.empty(n, np.float32)
        with self._lock:
            for a in self._kept:
                # held by the list, this loop and the call only: nobody else sees it
                if a.shape[0] == n and sys.getrefcount(a) == 3:
                    return a
            out = np.empty(n, np.float32)
            self._kept.append(out)
            while sum(a.nbytes for a in self._kept) > self.HELD:
                self._kept.pop(0)  # a holder keeps it alive; the list only lets go
            return out


_RESULTS = _ResultBuffers()


def _inceptionn_decode(k, B, comp, f, out):
    """INCEPTIONN's values; declined (False: the chain) for a non-finite step's payload."""
    p = f["payload"]
    if not np.isfinite(p[:4].view(np.float32)[0]):
        return False
    n = out.shape[0]
    n32, n16 = (int(c) for c in p[4:12].view(np.int32))
    at = 12 + 4 * n32
    ncodes = -(-n // 4)
    wide, mid = p[12:at].view(np.float32), p[at:at + 2 * n16].view(np.int16)
    low = p[at + 2 * n16:p.shape[0] - ncodes]
    wide, mid, low = (a if a.shape[0] else np.zeros(1, a.dtype) for a in (wide, mid, low))
    k.inceptionn_decode(p[p.shape[0] - ncodes:], wide, mid, low, comp.step, out, _CHUNKS_SELECT,
                        _WIDTHS_PER_BYTE)
    return out


# how many 2-bit codes of widths 3, 2 and 1 each byte holds
_WIDTHS_PER_BYTE = np.asarray([[sum(((b >> (2 * j)) & 3) == w for j in range(4)) for w in (3, 2, 1)]
                               for b in range(256)], np.int64)


def _two_bit_decode(k, B, codec, f, out):
    """TernGrad's and threshold's codes: the chain's table ``[0, 1, -1, 0] * scale``."""
    k.lookup_2bit(f["codes"], np.asarray([0.0, 1.0, -1.0, 0.0], np.float32) * f["scale"][0], out)


_NONE = np.zeros(0, np.float32)  # bucket_decode's lo for QSGD: nothing added


def _qsgd_decode(k, B, codec, f, out):
    factors = codec.factors(NUMPY, f["norms"])
    k.bucket_decode(f["codes"], codec.bits, codec.d, codec.s, factors, _NONE, out)


def _natural_decode(k, B, codec, f, out):
    k.natural_decode(f["exps"], f["signs"], codec.powers.view(np.int32), out.view(np.int32))


def _sign_decode(k, B, codec, f, out):
    k.bit_decode(f["signs"], np.concatenate([-f["scale"], f["scale"]]), out)


def _onebit_decode(k, B, codec, f, out):
    k.bit_decode(f["signs"], np.concatenate([f["neg"], f["pos"]]), out)


def _onebit_columns_decode(k, B, codec, f, out):
    k.bit_decode_columns(f["signs"], f["neg"], f["pos"], out)


def _uniform_decode(k, B, codec, f, out):
    k.bucket_decode(f["codes"], codec.bits, codec.d, 0, f["scales"], f["mins"], out)


def _eightbit_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], codec.levels, np.float32(f["scale"][0]), out)


def _sketchml_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], f["means"], np.float32(1.0), out)


_DECODERS = {"signsgd": _sign_decode, "efsignsgd": _sign_decode, "signum": _sign_decode,
             "natural": _natural_decode, "inceptionn": _inceptionn_decode,
             "uniform": _uniform_decode, "eightbit": _eightbit_decode, "sketchml": _sketchml_decode,
             "qsgd": _qsgd_decode, "terngrad": _two_bit_decode, "threshold": _two_bit_decode,
             "onebit": _onebit_decode}

set_host_fast_paths(host_encoder, host_decoder)
