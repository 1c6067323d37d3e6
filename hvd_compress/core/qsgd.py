"""QSGD (Alistarh et al., NeurIPS 2017): its codec, bucketed, and its integer-sum form.

Fields (``n`` values, bucket ``d``): ``norms float32[ceil(n/d)]``, then ``codes``
of ``ceil(log2(2s+1))`` bits per value.  The helpers that turn sums into scales
(:meth:`QSGDCodec.scales`, :meth:`QSGDCodec.inverse`, :meth:`QSGDCodec.factors`) are
public so that a fast path derives them exactly as the chain does.
"""

from __future__ import annotations

import math

from .bitpack import Segment, pack_codes, unpack_values
from .codec import Codec, _flagged


class QSGDCodec(Codec):
    """QSGD (Alistarh et al., NeurIPS 2017), bucketed.

    For each bucket of ``d`` values with norm ``||v||``, value ``v_i`` becomes
    ``sign(v_i) * ||v|| * l_i / s`` where ``l_i = floor(s*|v_i|/||v|| + u_i)``
    and ``u_i ~ U[0, 1)``: unbiased, with variance at most
    ``min(d/s^2, sqrt(d)/s) * ||v||^2`` per bucket.  The code ``s + sign*l``
    in ``[0, 2s]`` takes ``ceil(log2(2s+1))`` bits.
    """

    name = "qsgd"
    needs_noise = True
    int_summable = True

    def __init__(self, params):
        super().__init__(params)
        self.s = int(params["levels"])
        self.d = int(params["bucket"])
        if not 1 <= self.s <= 127:
            raise ValueError(f"qsgd: levels must be in [1, 127] (codes of at most 8 bits), got {self.s}")
        self.bits = math.ceil(math.log2(2 * self.s + 1))

    def layout(self, n, cols=1):
        return [Segment("norms", "float32", -(-n // self.d)),
                Segment("codes", "uint8", -(-n * self.bits // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        d, s = self.d, self.s
        norms, inv = self.scales(B, v)
        scaled = B.bucket_scale(B.abs(v), inv, d)  # s*|v|/||v|| (a fresh array: in place)
        level = B.cast(B.iminimum(B.ifloor(B.iadd(scaled, noise)), float(s)), "uint8")
        # code = s + sign * level, in uint8: s + level - 2 * level * [v < 0]
        code = B.isub(level + s, B.cast(v < 0, "uint8") * level * 2)
        return {"norms": _flagged(norms, flag), "codes": pack_codes(B, code, self.bits)}

    def scales(self, B, v, sumsq=None):
        """``(norms, inv)``: each bucket's norm (float64 sum, float32) and ``s / norm``
        (0 for a zero bucket), float32; ``sumsq``: the buckets' float64 sums of squares
        where a fast path has them."""
        if sumsq is None:
            sumsq = B.bucket_sumsq64(v, self.d)
        norms = B.cast(B.sqrt(sumsq), "float32")
        return norms, self.inverse(B, norms)

    def inverse(self, B, norms):
        """``s / norm`` per bucket (0 for a zero bucket), float32: what ``|v|`` is multiplied
        by before rounding (also against the norms integer sums share)."""
        return B.where(norms > 0, B.div(float(self.s), B.where(norms > 0, norms, 1.0)), 0.0)

    def factors(self, B, norms):
        """What each bucket's codes minus ``s`` are multiplied by: ``norm / s``."""
        return B.div(norms, float(self.s))

    # -- integer sums: codes against the buckets' norms, the max over ranks -------------------
    @property
    def int_max_code(self) -> int:
        return self.s

    def int_scale_count(self, n):
        return -(-n // self.d)

    def int_bucket(self, n):
        return self.d

    def int_magnitudes(self, B, v):
        return B.abs(v)

    def int_scales(self, B, v, mag):
        return self.scales(B, v)[0]

    def int_unit(self, B, shared):
        return self.factors(B, shared)

    def int_levels(self, B, v, mag, noise, shared):
        scaled = B.bucket_scale(mag, self.inverse(B, shared), self.d)  # s|v|/N_b
        return B.cast(B.iminimum(B.ifloor(B.iadd(scaled, noise)), float(self.s)), "uint8")

    def decode_values(self, B, fields, n, cols=1):
        s = self.s
        return unpack_values(B, fields["codes"], self.bits, n, [float(c - s) for c in range(1 << self.bits)],
                             factors=self.factors(B, fields["norms"]), d=self.d)
