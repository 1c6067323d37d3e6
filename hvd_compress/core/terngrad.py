"""TernGrad (Wen et al., NeurIPS 2017): its codec and its integer-sum form (scaler sharing).

Fields (``n`` values): ``scale float32[1]``, then ``codes`` of 2 bits per value
(0 -> 0, 1 -> +scale, 2 -> -scale).  :meth:`TernGradCodec.sigma` is public so that a
fast path derives the clipping bound exactly as the chain does.
"""

from __future__ import annotations

from .bitpack import Segment, pack_codes, unpack_values
from .codec import Codec, _flagged, _ternary_table


class TernGradCodec(Codec):
    """TernGrad (Wen et al., NeurIPS 2017): ``{-1, 0, +1} * scale``.

    Values are first clipped to ``[-c*sigma, c*sigma]`` (``clip=c``, 2.5 in the
    paper; 0 turns clipping off), then ``scale = max|v|`` and each value becomes
    ``sign(v) * scale`` with probability ``|v|/scale``, else 0: unbiased for
    the clipped values.
    """

    name = "terngrad"
    needs_noise = True
    int_summable = True

    @property
    def clip(self) -> float:
        return float(self.params["clip"])

    def layout(self, n, cols=1):
        return [Segment("scale", "float32", 1), Segment("codes", "uint8", -(-n * 2 // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        c = self.clip
        if c > 0:
            sigma = self.sigma(B, B.sum64(v), B.sumsq64(v), B.shape(v)[0])
            mag = B.iminimum(B.abs(v), c * sigma)  # |clip(v)|; clipping keeps the sign
        else:
            mag = B.abs(v)
        scale = B.max(mag)
        prob = B.idiv(mag, B.where(scale > 0, scale, 1.0))  # |v| / scale, in place
        code = B.imul(B.cast(noise < prob, "uint8"), B.iadd(B.cast(v < 0, "uint8"), 1))
        return {"scale": B.reshape(_flagged(scale, flag), (1,)), "codes": pack_codes(B, code, 2)}

    @staticmethod
    def sigma(B, s1, s2, n: int):
        """The standard deviation (float32) of ``n`` values from their sum ``s1`` and sum of
        squares ``s2`` (float64)."""
        mean = B.div(s1, float(n))
        var = B.maximum(B.div(s2, float(n)) - mean * mean, 0.0)
        return B.cast(B.sqrt(var), "float32")

    def decode_values(self, B, fields, n, cols=1):
        # the four code values times the scale, then one look-up per byte
        return unpack_values(B, fields["codes"], 2, n, _ternary_table(B, fields["scale"]))

    # -- integer sums: codes against the max over ranks of max|clip(v)| (scaler sharing) --------
    def int_magnitudes(self, B, v):
        c = self.clip
        if c > 0:
            sigma = self.sigma(B, B.sum64(v), B.sumsq64(v), B.shape(v)[0])
            return B.iminimum(B.abs(v), c * sigma)
        return B.abs(v)

    def int_scales(self, B, v, mag):
        return B.max(mag)

    def int_unit(self, B, shared):
        return B.reshape(shared, (1,))

    def int_levels(self, B, v, mag, noise, shared):
        scale = shared[0]
        prob = B.idiv(mag, B.where(scale > 0, scale, 1.0))
        return B.cast(noise < prob, "uint8")
