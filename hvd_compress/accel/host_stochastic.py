"""Host fast paths that draw hashed noise: TernGrad, QSGD, their integer sums and the
stratified sampler of random-k and DGC (kernels: :mod:`.kernels_stochastic`).

When the noise is not given, TernGrad and QSGD hash each element's index under one
64-bit key drawn per step from the compressor's generator (the values TensorFlow's
compiled ops draw for the same key) instead of drawing ``n`` values, which alone took
a third of QSGD's step; the stream differs from the chain's, both uniform, and
explicit noise gives the chain's bits.  Their statistics pass (float64 sums, non-finite
exactly where a value is) also tells finiteness, so without error feedback there is
no separate check.  The scales come from the codec's own helpers (the reference
arithmetic).
"""

from __future__ import annotations

import numpy as np

from ..core.backend import NUMPY
from ..core.base import ef_sum_host
from ..core.bitpack import pack_codes
from ..core.intsum import _HostPasses
from ..core.qsgd import QSGDCodec
from ..core.sampling import Stratified
from ..core.signs import SignCodec
from ..core.terngrad import TernGradCodec
from .host import code_buffer, register, whole_step
from .host_signs import two_bit_decode
from .registry import ByClass


def _noise_args(B, v, noise, noise_source=None, key=None):
    """A kernel's noise arguments: the given noise and a zero key, or no noise and the
    halves of one 64-bit key (``key``, else drawn from ``noise_source``, the
    compressor's generator; the kernel hashes each element's index under it:
    ``kernels_stochastic._fill_uniform``)."""
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
    out = code_buffer(n, 2)
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
    out = code_buffer(n, 4) if packed else np.empty(n, np.uint8)  # 4-bit codes: packed by the kernel
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


def _subtract_decoded(B, codec, v, fields):
    """``v -= decoded`` (error feedback) for codecs whose kernel does not do it."""
    B.isub(v, codec.decode_values(B, fields, B.shape(v)[0]))


class IntSumHost:
    """The host passes of :class:`~hvd_compress.core.intsum.IntegerSum` (without error
    feedback): round 0's scales from one statistics pass that also tells finiteness
    (TernGrad's moments, QSGD's bucket sums of squares), round 1's codes straight into
    int32 lanes, and the lane sums decoded -- one pass each, the chain's bits for the same
    noise (without noise given, each element's index hashed under a key drawn at round 0,
    as the quantizers' kernels do)."""

    def __init__(self, k, B):
        self.k, self.B = k, B

    def scales(self, comp, v):
        """``(scales, cap)``: this rank's float32 scales and TernGrad's clipping cap (else
        None), or None where ``v`` is not finite (then the chain runs)."""
        k, B = self.k, self.B
        kind = _INT_KINDS.find(comp.codec)
        if kind == _TERNGRAD:
            got = _terngrad_scale(k, B, comp.codec, v)
            return None if got is None else (B.asarray([got[0]], "float32", like=v), got[1])
        if kind == _QSGD:
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
        kind = _INT_KINDS.find(comp.codec)
        if kind == _TERNGRAD:
            safe = sh[0] if sh[0] > 0 else np.float32(1.0)
        elif kind == _QSGD:
            inv = B.host_view(B.cast(comp.codec.inverse(B, shared), "float32"))
        args = _noise_args(B, v, noise, key=key)  # (signSGD: no noise, no key; unused)
        out = np.empty(nwords, np.int32)
        d = comp.codec.d if kind == _QSGD else 1
        self.k.intsum_words(B.host_view(v), *args, kind,
                            np.float32(np.inf if cap is None else cap), np.float32(safe), inv,
                            d, comp.m, comp.w, np.int64(bias & 0xFFFFFFFF), out)
        return B.from_host(out)

    def lanes(self, comp, words, n: int, unit, bias: int, out=None):
        """The decoded sum (float32[n]) of summed ``words``, into ``out`` where given."""
        B = self.B
        if out is None:
            out = np.empty(n, np.float32)
        u = _NO_UNIT if unit is None else B.host_view(B.cast(unit, "float32"))
        d = comp.codec.d if _INT_KINDS.find(comp.codec) == _QSGD else max(n, 1)
        self.k.intsum_lanes(B.host_view(words), n, comp.w, np.int64(bias & 0xFFFFFFFF), u, d,
                            comp.vote, out)
        return out


_NO_UNIT = np.empty(0, np.float32)


def _stratified(k, B, n, kk, key0, key1):
    """:func:`~hvd_compress.core.sampling.stratified_indices`'s indices and sizes from
    one kernel (the chain makes about twenty passes of integer operations)."""
    indices, sizes = np.empty(kk, np.int64), np.empty(kk, np.int64)
    k.stratified(np.int64(n), np.int64(kk), np.uint64(int(B.to_numpy(key0))),
                 np.uint64(int(B.to_numpy(key1))), indices, sizes)
    return B.from_host(indices), B.from_host(sizes)


# the integer sums' kernel kinds (intsum_words), by the codec of the values
_TERNGRAD, _QSGD, _SIGN = 0, 1, 2
_INT_KINDS = ByClass({TernGradCodec: _TERNGRAD, QSGDCodec: _QSGD, SignCodec: _SIGN})

_NONE = np.zeros(0, np.float32)  # bucket_decode's lo for QSGD: nothing added


def _qsgd_decode(k, B, codec, f, out):
    factors = codec.factors(NUMPY, f["norms"])
    k.bucket_decode(f["codes"], codec.bits, codec.d, codec.s, factors, _NONE, out)


register(TernGradCodec, encoder=whole_step(_stats_step(_terngrad)), decoder=two_bit_decode)
register(QSGDCodec, encoder=whole_step(_stats_step(_qsgd)), decoder=_qsgd_decode,
         decodes=lambda codec, cols: 8 % codec.bits == 0)
register(_HostPasses, encoder=lambda k, B, passes, cols: IntSumHost(k, B))
register(Stratified, encoder=lambda k, B, marker, cols:
         lambda n, kk, key0, key1: _stratified(k, B, n, kk, key0, key1))
