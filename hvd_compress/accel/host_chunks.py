"""Host fast paths of the two-phase exchange's chunks: every chunk of a tensor in one call.

The two-phase exchange (:mod:`hvd_compress.core.twophase`) encodes a tensor's ``p``
chunks, sums an owner's ``p`` payloads and decodes the ``p`` owners' payloads; one codec
call each, that is ``3 p + 1`` calls a tensor, whose fixed cost (Python, kernel dispatch:
0.1-0.6 ms a call on these CPUs) grows with the workers while the values do not.  A chunk
path does each of the three in one kernel call over all the chunks
(:mod:`.kernels_chunks`), with the per-chunk codec's bits; the core asks the backend for
one (``B.chunk_path``) and runs the calls one by one where there is none or it declines.

It serves where every chunk is small (fewer than :data:`~.jit.SERIAL_BELOW` values): the
per-chunk kernels then run serially, in the order these sum in, so the bits are theirs;
or where there are :data:`MANY` chunks or more, a thread each (larger chunks sum as one
thread does, which the per-chunk kernels' pool of threads gives up to a last bit of a
float64 sum: :mod:`.jit`).  Fewer, larger chunks keep a call each: their calls' fixed
cost is little beside their values, and each call's pool shares out one chunk.

Registered per codec or compressor class, exactly (a subclass computes something else):
1-bit SGD (:class:`~hvd_compress.core.onebit.OneBitCodec`) on chunks of one column,
top-k (:class:`~hvd_compress.core.sparsifiers.TopK`, no quantizer of its values), whose
owners are top-k too, and DGC (:class:`~hvd_compress.core.dgc.DGC`: its workers' chunks and
an owner's sum; its owners are top-k).

A chunk's error-feedback residual (DGC: ``u`` and ``v``) stays in its own state
(``name#j/p``: checkpoints and elastic resizes see nothing new); the chunk path keeps
those of a tensor as views of one buffer, made once (and again after anything replaced
one: a restored checkpoint, a resize's carry).
"""

from __future__ import annotations

import numpy as np

from ..core import sampling
from ..core.backend import NUMPY
from ..core.chunkset import Chunks
from ..core.dgc import ADAPT_ROUNDS, DGC, LOWER, sample_size
from ..core.onebit import OneBitCodec
from ..core.quantizers import QuantizerCompressor
from ..core.sparsifiers import PURPOSE_DGC_SAMPLE, TopK, count_for
from .host import RESULTS, numba_kernels
from .registry import ByClass, requested

__all__ = ["CHUNK_PATHS", "chunk_path", "DGCChunks", "OneBitChunks", "TopKChunks"]

_HEAD = 8  # a 1-bit payload of one column: pos, neg (float32), then the signs
#: chunks enough to keep a thread pool busy a chunk a thread (a 16-core machine's)
MANY = 16


def _longest(bounds) -> int:
    """The longest of chunks ``bounds``: the first or the last, as the two-phase exchange
    cuts them (:func:`~hvd_compress.core.twophase.chunk_bounds`: lengths differ by one)."""
    return max(bounds[0][1] - bounds[0][0], bounds[-1][1] - bounds[-1][0])


def _fit(bounds) -> bool:
    """Whether chunks ``bounds`` are many (a thread each) or all small (serial kernels)."""
    from .jit import SERIAL_BELOW  # (numba: loaded with the kernels, not with the package)
    return len(bounds) >= MANY or _longest(bounds) < SERIAL_BELOW


def _starts(bounds) -> np.ndarray:
    """The chunks' first values and the end (int64): segment ``s`` is ``[starts[s],
    starts[s+1])``."""
    return np.asarray([a for a, _ in bounds] + [bounds[-1][1]], np.int64)


def _segments(sizes) -> np.ndarray:
    """:func:`_starts` of segments of ``sizes`` values laid end to end from 0."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _counts(ratio, lengths) -> np.ndarray:
    """:func:`~hvd_compress.core.sparsifiers.count_for` of chunks of ``lengths`` values at
    ``ratio`` (one, or one a chunk), element-wise in its float64 arithmetic (int64)."""
    m = np.asarray(lengths, np.int64)
    return np.clip(np.ceil(ratio * m - 1e-9), 1, m).astype(np.int64)


def _laid_out(nbytes):
    """``(offsets, buffer)``: payloads of ``nbytes`` bytes each, end to end in one fresh
    byte buffer."""
    return _segments(nbytes)[:-1], np.empty(int(np.sum(nbytes)), np.uint8)


class _ChunkPath:
    """What the chunk paths share: the kernels ``k`` and backend ``B``, and the chunks'
    error-feedback residuals as views of one buffer."""

    def __init__(self, k, B, comp=None):
        self.k, self.B = k, B

    def _residuals(self, comp, name, metas, n, like, field="residual"):
        """``(block, states)``: the chunks' residuals (or another per-chunk state ``field``)
        as views of one buffer (host numpy), and their states, in ``comp.states`` as the
        per-chunk path would make them."""
        B = self.B
        key = (name, len(metas), field)
        blocks = comp.__dict__.setdefault("_chunk_blocks", {})
        held = blocks.get(key)
        if held is not None:
            states = comp.states
            if all(states.get(m.name) is st and getattr(st, field) is view
                   for m, st, view in zip(metas, held[1], held[2])):
                return held[0], held[1]
        block = np.zeros(n, np.float32)
        kept, views, at = [], [], 0
        for meta in metas:
            st = comp.state(meta, like=like)
            m = meta.numel
            block[at:at + m] = B.host_view(B.reshape(getattr(st, field), (-1,)))
            setattr(st, field, B.from_host(block[at:at + m]))
            kept.append(st)
            views.append(getattr(st, field))
            at += m
        blocks[key] = (block, kept, views)
        return block, kept

    def _start(self, comp, v, name, metas, bounds):
        """What an encode of ``v``'s chunks starts from: ``(g, r, states, starts)``,
        ``v``'s host view, the chunks' residuals as one buffer, their states and the
        segments; None (nothing touched) where a value of ``v`` is not finite."""
        B = self.B
        if not bool(B.all_finite(v)):
            return None
        g = B.host_view(v)
        r, states = self._residuals(comp, name, metas, g.shape[0], v)
        return g, r, states, _starts(bounds)

    def _payloads(self, out, metas, states, offs, nbytes):
        """``out``'s payloads (host bytes at ``offs``) as the chunks' encodings, each
        chunk's step counted."""
        for st in states:
            st.step = st.step + 1
        return Chunks(self.B, out, offs, nbytes, metas, self)

    def rows(self, sets):
        """``(buffer, splits)``: the alltoall's send buffer of chunk sets ``sets`` (one a
        tensor, all of ``p`` chunks) -- for each rank ``j`` in turn, every tensor's chunk
        ``j`` -- as host bytes, and the bytes for each rank (int64)."""
        if len(sets) == 1:
            return sets[0].host, sets[0].nbytes
        sizes = np.stack([c.nbytes for c in sets], axis=1)  # (p, tensors)
        at = _segments(sizes.reshape(-1))
        out = np.empty(int(at[-1]), np.uint8)
        at = at[:-1].reshape(sizes.shape)
        for i, c in enumerate(sets):
            self.k.seg_copy(c.host, c.offs, c.nbytes, out, np.ascontiguousarray(at[:, i]))
        return out, sizes.sum(axis=1)

    def _host(self, buf):
        """``buf`` (a backend array of bytes) as a flat host numpy view."""
        return self.B.host_view(self.B.reshape(buf, (-1,)))


class OneBitChunks(_ChunkPath):
    """1-bit SGD's chunks (one column each, error feedback on): encode, an owner's sum,
    every owner's chunk decoded into place."""

    @staticmethod
    def takes(comp, bounds) -> bool:
        """Whether these chunks go this way: the codec exactly 1-bit's, error feedback on,
        one column a chunk, every chunk small."""
        return isinstance(comp, QuantizerCompressor) and type(comp.codec) is OneBitCodec and \
            comp.ef and _fit(bounds)

    # -- the worker's chunks --------------------------------------------------------------
    def encode(self, comp, v, name, bounds, metas):
        """Every chunk of ``v`` (flat float32, host) encoded as ``comp.encode`` would, each
        chunk's state stepped; None (nothing touched) where a value is not finite."""
        k, start = self.k, self._start(comp, v, name, metas, bounds)
        if start is None:
            return None
        g, r, states, starts = start
        p = len(bounds)
        npos, spos, sneg = np.empty(p, np.int64), np.empty(p), np.empty(p)
        if k.seg_sign_sums(r, g, starts, npos, spos, sneg).any():
            return None  # an overflow of the residual's sum: the chunks' own way
        sizes = np.diff(starts)
        nneg = sizes - npos
        pos = np.where(npos > 0, spos / np.maximum(npos.astype(np.float64), 1.0), 0.0).astype(np.float32)
        neg = np.where(nneg > 0, sneg / np.maximum(nneg.astype(np.float64), 1.0), 0.0).astype(np.float32)
        nbytes = self.payload_sizes(sizes)
        offs, out = _laid_out(nbytes)
        k.seg_onebit_pack(r, g, starts, pos, neg, out, offs + _HEAD)
        heads = np.stack([pos, neg], axis=1).view(np.uint8)  # (p, 8): pos, neg bytes
        out[offs[:, None] + np.arange(_HEAD)] = heads
        return self._payloads(out, metas, states, offs, nbytes)

    @staticmethod
    def payload_sizes(lengths):
        """Bytes of the payloads of chunks of ``lengths`` values (int64 array)."""
        return _HEAD + (np.asarray(lengths, np.int64) + 7) // 8

    # -- an owner's sum, and every owner's chunk ------------------------------------------
    @staticmethod
    def _tables(buf, offs):
        """``(p, 2)`` float32: each payload's ``[neg, pos]`` (a bit's value)."""
        head = buf[offs[:, None] + np.arange(_HEAD)].reshape(-1).view(np.float32).reshape(-1, 2)
        return np.ascontiguousarray(head[:, ::-1])

    def aggregate(self, comp, buf, offs, meta, nbytes=None):
        """The sum, in rank order, of the payloads at byte offsets ``offs`` of ``buf`` (all
        of ``meta``'s chunk), in ``meta``'s shape: ``comp.aggregate``'s."""
        B = self.B
        h = self._host(buf)
        offs = np.asarray(offs, np.int64)
        out = RESULTS.take(meta.numel)
        self.k.onebit_sum(h, offs + _HEAD, self._tables(h, offs), meta.numel, out)
        return B.reshape(B.from_host(out), meta.shape)

    def decode_into(self, buf, offs, sizes, out, factor):
        """Payload ``s`` (at byte offset ``offs[s]`` of ``buf``, ``sizes[s]`` values) decoded
        into the next ``sizes[s]`` values of ``out`` (float32 host), times ``factor``."""
        h = self._host(buf)
        offs = np.asarray(offs, np.int64)
        starts = _segments(sizes)
        self.k.seg_onebit_decode(h, offs + _HEAD, starts, self._tables(h, offs),
                                 np.float32(factor), factor != 1.0, out)


class TopKChunks(_ChunkPath):
    """Top-k's chunks (error feedback on, no quantizer of the values): the k largest
    magnitudes of each chunk (``k = ceil(ratio * m)``, ties to the lower index) with
    their int32 indices, an owner's sum, every owner's chunk decoded into place."""

    def __init__(self, k, B, comp=None):
        super().__init__(k, B, comp)
        self.ratio = float(comp.params["ratio"])

    @staticmethod
    def takes(comp, bounds) -> bool:
        """Whether these chunks go this way: exactly top-k, error feedback on, no quantizer
        of the values, int32 indices, chunks many or all small."""
        return type(comp) is TopK and comp._codec is None and comp.ef and \
            _longest(bounds) < 2 ** 31 and _fit(bounds)

    def counts(self, lengths) -> np.ndarray:
        """``k`` of chunks of ``lengths`` values (int64): ``count_for(ratio, m)``'s float64
        arithmetic, element-wise."""
        return _counts(self.ratio, lengths)

    # -- the worker's chunks --------------------------------------------------------------
    def encode(self, comp, v, name, bounds, metas):
        """Every chunk of ``v`` (flat float32, host) encoded as ``comp.encode`` would, each
        chunk's state stepped; None (nothing touched) where a value, or its sum with the
        residual, is not finite (the chunks' own calls then take the step)."""
        k, start = self.k, self._start(comp, v, name, metas, bounds)
        if start is None:
            return None
        g, r, states, starts = start
        if k.seg_nonfinite(r, g, starts).any():
            return None  # an overflow of the residual's sum: the chunks' own way
        ks = self.counts(np.diff(starts))
        nbytes = 8 * ks
        offs, out = _laid_out(nbytes)
        k.seg_topk_pack(r, g, starts, ks, out, offs)
        return self._payloads(out, metas, states, offs, nbytes)

    def payload_sizes(self, lengths):
        """Bytes of the payloads of chunks of ``lengths`` values (int64 array)."""
        return 8 * self.counts(lengths)

    # -- an owner's sum, and every owner's chunk ------------------------------------------
    def aggregate(self, comp, buf, offs, meta, nbytes=None):
        """The sum, in rank order, of the payloads at byte offsets ``offs`` of ``buf`` (all
        of ``meta``'s chunk, ``nbytes`` bytes each where given), in ``meta``'s shape:
        ``comp.aggregate``'s."""
        B = self.B
        out = RESULTS.take(meta.numel)
        kk = int(self.counts([meta.numel])[0]) if nbytes is None else int(nbytes) // 8
        bad = self.k.topk_sum(self._host(buf), np.asarray(offs, np.int64), kk, out)
        if bad:
            raise ValueError(f"top-k payloads of {meta.name!r}: {bad} indices outside its "
                             f"{meta.numel} values")
        return B.reshape(B.from_host(out), meta.shape)

    def decode_into(self, buf, offs, sizes, out, factor):
        """Payload ``s`` (at byte offset ``offs[s]`` of ``buf``, ``sizes[s]`` values) decoded
        into the next ``sizes[s]`` values of ``out`` (float32 host), times ``factor``."""
        starts = _segments(sizes)
        bad = self.k.seg_topk_decode(self._host(buf), np.asarray(offs, np.int64), starts,
                                     self.counts(np.diff(starts)), np.float32(factor),
                                     factor != 1.0, out)
        if bad.any():
            raise ValueError(f"top-k payloads: {int(bad.sum())} indices outside their chunks")


class DGCChunks(_ChunkPath):
    """DGC's chunks (no quantizer, no clipping, density under 1): each chunk's momentum
    correction, sampled threshold (its own stream: the chunk's name), correction loop,
    selection and masking as ``comp.encode`` does the chunk -- the chain where a chunk is
    selected exactly, :func:`.host_select._dgc` where sampled -- and an owner's sum of the
    workers' payloads (top-k's, ``k`` from their size).  The owners are top-k: their chunks
    decode by :class:`TopKChunks`.  The chunks' ``u`` and ``v`` are views of two buffers;
    where they are not known finite (made or replaced since the last step here, or an
    overflow in it) they are checked first, and a NaN or Inf there, in the gradient or
    among the sampled magnitudes takes the per-chunk calls."""

    @staticmethod
    def takes(comp, bounds) -> bool:
        """Whether these chunks go this way: exactly DGC, no quantizer, no clipping, int32
        indices, chunks many or all small."""
        return type(comp) is DGC and comp._codec is None and \
            float(comp.params["clip_norm"]) <= 0 and _longest(bounds) < 2 ** 31 and _fit(bounds)

    @staticmethod
    def _keys(comp, name, metas, steps):
        """Each chunk's two stream keys for its sampled positions at its ``steps``
        (:func:`~hvd_compress.core.sampling.stream_keys`, all chunks at once; the part
        without the step kept per tensor)."""
        seed = int(comp.params["seed"])
        held = comp.__dict__.setdefault("_chunk_keys", {})
        base = held.get((name, len(metas), seed))
        if base is None:
            base = held[(name, len(metas), seed)] = np.asarray(
                [sampling.name_base(seed, m.name, PURPOSE_DGC_SAMPLE) for m in metas], np.int64)
        return sampling.step_keys(NUMPY, base, steps & sampling.MASK32)

    @staticmethod
    def _lowered(thr):
        """``(p, ADAPT_ROUNDS + 1)`` float32: each threshold, then each lowering by
        ``LOWER``, with the arithmetic :meth:`DGC.lowered` makes on a float32 scalar
        (float32 under NumPy 2's rules, float64 under NumPy 1's), each rounded to float32."""
        dtype = type(np.float32(1) * LOWER)
        out = np.empty((thr.shape[0], ADAPT_ROUNDS + 1), np.float32)
        cur = thr.astype(dtype)
        for r in range(ADAPT_ROUNDS + 1):
            out[:, r] = cur
            cur = (cur * LOWER).astype(dtype)
        return out

    def encode(self, comp, v, name, bounds, metas):
        """Every chunk of ``v`` (flat float32, host) encoded as ``comp.encode`` would, each
        chunk's state stepped; None (nothing touched) where the per-chunk calls must run."""
        B, k = self.B, self.k
        if not bool(B.all_finite(v)):
            return None
        g = B.host_view(v)
        u, states = self._residuals(comp, name, metas, g.shape[0], v, "u")
        w, _ = self._residuals(comp, name, metas, g.shape[0], v, "v")
        finite = comp.__dict__.setdefault("_chunk_finite", {})
        key = (name, len(metas))
        if finite.get(key) != (id(u), id(w)):
            if not (np.isfinite(u).all() and np.isfinite(w).all()):
                return None
            finite[key] = (id(u), id(w))
        steps = np.asarray([st.step for st in states], np.int64)
        density = {int(t): comp.density(int(t)) for t in np.unique(steps)}
        if max(density.values()) >= 1.0:
            return None  # momentum alone: the per-chunk calls
        starts = _starts(bounds)
        lengths = np.diff(starts)
        d = np.asarray([density[int(t)] for t in steps]) if len(density) > 1 else \
            np.full(len(metas), next(iter(density.values())))
        ks = _counts(d, lengths)
        ratio = float(comp.params["sample_ratio"])
        pairs = list(zip(lengths.tolist(), d.tolist()))
        plan = {}  # (length, density): (positions sampled, 0 where exact; the rank wanted)
        for n, dens in set(pairs):
            s = sample_size(n, dens, ratio)
            plan[n, dens] = (0, 1) if s == n else (s, count_for(dens, s))
        sizes, wants = (np.asarray(c, np.int64) for c in zip(*[plan[q] for q in pairs]))
        m, nesterov = np.float32(comp.params["momentum"]), bool(comp.params["nesterov"])
        thr = np.zeros(len(metas), np.float32)
        if sizes.any():
            key0, key1 = self._keys(comp, name, metas, steps)
            at = _segments(sizes)
            pos = np.empty(int(at[-1]), np.int64)
            k.seg_stratified(starts, sizes, key0.astype(np.uint64), key1.astype(np.uint64),
                             at, pos)
            if k.seg_dgc_thresholds(g, u, w, pos, at, sizes, wants, m, nesterov, thr).any():
                return None  # an Inf/NaN momentum sampled: the chunks' own way
        nbytes = 8 * ks
        offs, out = _laid_out(nbytes)
        if k.seg_dgc_pack(g, u, w, starts, ks, self._lowered(thr), sizes > 0, m, nesterov,
                          bool(comp.params["masking"]), out, offs).any():
            finite.pop(key, None)  # an overflow: checked again next step
        return self._payloads(out, metas, states, offs, nbytes)

    def aggregate(self, comp, buf, offs, meta, nbytes=None):
        """The sum, in rank order, of the workers' payloads of ``meta``'s chunk (``nbytes``
        each: ``k`` from the size, the density being the step's): top-k's."""
        if nbytes is None:
            raise ValueError("DGC's chunk path: an owner's sum needs the payloads' size")
        return TopKChunks.aggregate(self, comp, buf, offs, meta, nbytes)


#: the chunk paths, by codec class (a quantizer's) or compressor class (each checks the
#: class exactly: ``takes``)
CHUNK_PATHS = ByClass({OneBitCodec: OneBitChunks, TopK: TopKChunks, DGC: DGCChunks})


def chunk_path(B, comp):
    """The chunk path for ``comp``'s chunks on host backend ``B``, or None: fast paths
    turned off, numba missing, or none for its codec or its class."""
    impl = CHUNK_PATHS.find(getattr(comp, "codec", None)) or CHUNK_PATHS.find(comp)
    if impl is None or not requested():
        return None
    k = numba_kernels()
    return impl(k, B, comp) if k else None
