"""Host fast paths of the selections: top-k, adaptive quantization, DGC and INCEPTIONN
(kernels: :mod:`.kernels_select`).

The k largest magnitudes (ties to the lower index, the reference's selection) come
from a cut read off a strided sample, one pass that counts and one that gathers the
candidates, and the k largest of those; where far more or fewer pass, from counts of
the values' float32 bit patterns (:func:`_top_by_bits`, no sort).  Payloads, decoded
values and state are the chain's bits (``tests/test_kernels.py``).
"""

from __future__ import annotations

import numpy as np

from ..core.backend import prime_stride
from ..core.base import ef_sum_host
from ..core.dgc import DGC
from ..core.sparsifiers import TopK, index_dtype
from ..core.variable import AdaptiveQuantization, Inceptionn
from .host import code_buffer, ef_encoder, register, whole_step

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
    is read from a strided sample of ``|g + residual|`` (:func:`_sample_cut`); one pass
    counts the values at or above it and the non-finite ones, reading ``y = residual +
    g`` without storing it (without error feedback: ``g``); one more pass gathers those
    at or above it (with error feedback, writing the residual ``y``), and the k largest
    of them are the top-k (:func:`_k_largest`).  Where fewer than k pass, or far more,
    the top-k comes from :func:`_top_by_bits`.  Non-finite: nothing is touched where
    ``g`` is not finite; an overflow of the sum is added and undone, as the core's host
    path does (:func:`ef_sum_host`).  The values sent leave the residual (0, as the
    chain's ``v + -v``)."""
    gh = B.host_view(g)
    n, ef = gh.shape[0], residual is not None
    kk, itype, chunks = comp.k_for(comp.meta_for(g)), index_dtype(n), _select_chunks(n)
    vh = B.host_view(residual) if ef else gh
    t = _sample_cut(gh, vh if ef else None, kk)
    added = ef and not np.isfinite(t)  # no cut (a small tensor): the sum written at once
    if added and not bool(B.all_finite(g)):
        return None, residual, False
    counts, bad = k.ef_count(vh, gh, t, chunks) if ef and not added else \
        k.add_count(vh, gh, t, ef, chunks)
    if bad.any():
        if ef and (added or bool(B.all_finite(g))):  # float32 overflow of the sum: undone
            if not added:
                k.add_count(vh, gh, t, True, chunks)
            B.isub(residual, g)
        return None, residual, False
    passed = int(counts.sum())
    if kk <= passed <= _most_gathered(n, kk):
        cand, vals = _gather_pass(k, vh, gh if ef and not added else None, t, counts, itype)
        keep = _k_largest(vals, kk)
        idx, values = cand[keep], vals[keep]
    else:
        if ef and not added:  # the sum written, then selected
            k.add_count(vh, gh, t, True, chunks)
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


def _gather_pass(k, vh, gh, t, counts, itype):
    """The indices of the values ``|v| >= t`` (``counts`` per stretch), in index order,
    and those values, by one pass (:func:`~.kernels_select.at_least`); with ``gh``, of
    ``v = vh + gh``, written into ``vh`` in that pass (:func:`~.kernels_chunks.ef_add_gather`:
    error feedback's sum)."""
    cand, vals = np.empty(int(counts.sum()), itype), np.empty(int(counts.sum()), np.float32)
    starts, t = np.cumsum(counts) - counts, np.float32(t)
    if gh is None:
        k.at_least(vh, t, starts, cand, vals, counts.shape[0])
    else:
        k.ef_add_gather(vh, gh, t, starts, cand, vals, counts.shape[0])
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
    gh, uh, vh = B.host_view(g), B.host_view(st.u), B.host_view(st.v)
    n, kk = vh.shape[0], comp.k_for(meta)
    m, nesterov = np.float32(comp.params["momentum"]), bool(comp.params["nesterov"])

    def new_mag(pos):  # the sampled positions' |v| after the update, as the kernel makes it
        return B.from_host(k.dgc_sample(gh, uh, vh, B.host_view(pos), m, nesterov))

    thr = comp.sample_threshold(new_mag, meta, st.step, like=g)
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
            idx, vals = _gather_pass(k, vh, None, t, per_chunk(t), itype)
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
    codes = code_buffer(n, 2)
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


def _topk_encoder(k, B, comp, cols):
    """Top-k's whole step; with a quantizer of the values (``topk+qsgd``): the chain."""
    return None if comp.codec is not None else whole_step(_topk)(k, B, comp, cols)


def _dgc_encoder(k, B, comp, cols):
    """DGC's step (``DGC._encode_fused``: its state is ``u`` and ``v``); with a quantizer
    of the values: the chain."""
    return None if comp.codec is not None else lambda g, st, meta, _: _dgc(k, B, comp, g, st, meta)


def _inceptionn_encoder(k, B, comp, cols):
    """INCEPTIONN's payload; with error feedback: the chain."""
    return None if comp.ef else ef_encoder(_inceptionn)(k, B, comp, cols)


# the fewest elements the whole-payload fast paths take (adaq's counts cost more than
# the chain's selection on smaller tensors)
register(TopK, encoder=_topk_encoder, smallest=1 << 16)
register(AdaptiveQuantization, encoder=ef_encoder(_adaq), smallest=1 << 16)
register(DGC, encoder=_dgc_encoder)
register(Inceptionn, encoder=_inceptionn_encoder, decoder=_inceptionn_decode)
