"""Sign compressors: signSGD, Signum (majority vote) and EF-signSGD.

Payload (``n`` values): ``scale float32[1]``, then ``signs 1-bit x n`` (bit 1: the
value is >= 0, so 0 counts as positive, as GRACE and the papers' code do).
A value decodes to ``+scale`` or ``-scale``.

- **signSGD** (Bernstein et al., ICML 2018, "signSGD: Compressed Optimisation
  for Non-Convex Problems"; majority vote: Bernstein et al., ICLR 2019): each
  rank sends ``sign(g)``; the ranks' signs are combined by majority vote,
  ``sign(sum_r sign(g_r))``.  ``vote=false`` averages the signs instead.  The
  scale is 1 (NaN for a non-finite step), or 0 for an all-zero tensor, so that a
  parameter a rank did not use does not vote +.
- **Signum** (same paper): the sign of a momentum kept in the compressor,
  ``m <- beta*m + (1-beta)*g`` (``momentum=beta``, 0.9 in the paper; ``m``
  starts at 0 and is checkpointed), combined by majority vote.
- **EF-signSGD** (Karimireddy et al., ICML 2019, "Error Feedback Fixes SignSGD"):
  ``p = g + e``, send ``(||p||_1 / n) * sign(p)``, keep ``e = p - sent``: the
  scaled sign with error feedback (nothing lost).  The ranks' values are averaged.

The vote is the mean of the ranks' updates in the engine's terms: the aggregate
(a sum over ranks) is ``p * sign(sum of signs)``, so the average the optimizer
applies is the vote itself.  A tie (as many + as -, common with two workers) votes
0, not + as GRACE's ``>= 0`` would: with two ranks that disagree half the time, a
tie counted as + would push every such coordinate the same way each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Encoded, host_nonfinite, nan_flag, zero_nonfinite
from .bitpack import Segment, join_segments, pack_codes, unpack_values
from .quantizers import Codec, QuantizerCompressor, _flagged
from .state import TensorState, per_rank


class SignCodec(Codec):
    """``scale`` and one sign bit per value; ``scaled``: the scale is ``||v||_1 / n``
    (EF-signSGD) rather than 1 (signSGD, Signum)."""

    name = "signsgd"
    scaled = False
    int_summable = True

    def layout(self, n, cols=1):
        return [Segment("scale", "float32", 1), Segment("signs", "uint8", -(-n // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        n = B.shape(v)[0]
        if self.scaled:  # the L1 norm summed in float64: every framework gets the same bits
            scale = B.cast(B.div(B.sum64(B.abs(v)), float(n)), "float32")
        else:  # 1, or 0 for an all-zero tensor (an unused parameter must not vote +)
            scale = B.cast(B.absmax(v) > 0, "float32")
        return {"scale": B.reshape(_flagged(scale, flag), (1,)), "signs": pack_codes(B, v >= 0, 1)}

    def decode_values(self, B, fields, n, cols=1):
        scale = B.reshape(fields["scale"], (1,))
        return unpack_values(B, fields["signs"], 1, n, B.concat([-scale, scale]))

    # -- integer sums: signs summed, then voted (``vote``) or averaged; no scale ---------------
    @property
    def int_vote(self) -> bool:
        return bool(self.params.get("vote", True))

    def int_magnitudes(self, B, v):
        return None

    def int_scales(self, B, v, mag):
        return B.scalar(0.0, like=v)  # carries only finiteness

    def int_unit(self, B, shared):
        return None

    def int_levels(self, B, v, mag, noise, shared):
        return B.cast(v != 0, "uint8")


class EFSignCodec(SignCodec):
    name = "efsignsgd"
    scaled = True
    int_summable = False


class SignumCodec(SignCodec):
    """Signum's codec: signSGD's payload; ``beta``, the momentum, is there for a fused
    encoder, which takes the momentum where other codecs take the residual and returns
    the momentum to keep: the new one (in host memory after a finite step alone; a
    device's encoder, which cannot branch on finiteness, returns the old one after NaN/Inf)."""

    name = "signum"
    int_summable = False  # its compressor keeps a momentum: no sum=int form

    def __init__(self, params):
        super().__init__(params)
        self.beta = float(params["momentum"])


@dataclass(eq=False)
class SignumState(TensorState):
    """Signum's momentum ``m`` (None for signSGD, which keeps none)."""

    momentum: Any = per_rank()


class SignCompressor(QuantizerCompressor):
    """signSGD and Signum: one sign bit per value, majority vote (``vote``) or the mean
    of signs; ``momentum`` > 0 sends the sign of the compressor's momentum (Signum).
    Their aggregates do not scale with the inputs (a scale of 1), so Horovod's
    ``gradient_predivide_factor`` does not apply (``scale_free``)."""

    scale_free = True
    State = SignumState

    def __init__(self, codec_name="signsgd", params=None, backend=None, rank=0, world_size=1,
                 name="signsgd", **kw):
        super().__init__(codec_name, params, backend, rank, world_size, **kw)
        self.name = name
        self.beta = float(self.params.get("momentum", 0.0))
        self.vote = bool(self.params.get("vote", True))

    def owner_spec(self):
        """An owner of the two-phase exchange sends the sign of its chunk's vote (or mean of
        signs) with signSGD's codec: Signum's momentum was the workers'."""
        return f"signsgd:vote={str(self.vote).lower()}"

    def _new_state(self, meta, like):
        st = super()._new_state(meta, like)
        if self.beta:
            st.momentum = self.B.zeros((meta.numel,), "float32", like=like)
        return st

    def _momentum(self, g, st):
        """``beta * m + (1 - beta) * g`` (a new tensor)."""
        return st.momentum * self.beta + g * (1.0 - self.beta)

    def _encode_fused(self, g, meta, st, noise):
        if not self.beta:
            return super()._encode_fused(g, meta, st, noise)
        # Signum's codec: the fused encoder takes the momentum and returns the one to keep
        # (SignumCodec); finite a Python bool in host memory, a 0-d tensor on a device
        B = self.B
        fused = B.fused_encoder(self.codec, 1, like=g)
        if fused is None:
            return None
        fields, momentum, finite = fused(g, st.momentum, None, None)
        if host_nonfinite(finite):  # NaN/Inf: the reference step (the momentum stays)
            return self._encode_momentum(g, meta, st, noise)
        if finite is not True:  # a device's: the scale flagged, no branch on its value
            fields = dict(fields, scale=_flagged(fields["scale"], nan_flag(B, finite, g)))
        st.momentum = momentum  # the new one, or (a device's) the old after NaN/Inf
        payload = join_segments(B, self.codec.layout(meta.numel), fields)
        return Encoded(payload, meta, self.payload_nbytes(meta))

    def _encode_host(self, g, meta, st, noise) -> Encoded:
        if not self.beta:
            return super()._encode_host(g, meta, st, noise)
        return self._encode_momentum(g, meta, st, noise)

    def _encode_device(self, g, meta, st, noise) -> Encoded:
        if not self.beta:
            return super()._encode_device(g, meta, st, noise)
        return self._encode_momentum(g, meta, st, noise)

    def _encode_momentum(self, g, meta, st, noise) -> Encoded:
        """Signum's step, host or device: the new momentum's signs; where it is not
        finite (NaN/Inf in ``g``, or an overflow) the payload decodes to NaN and the
        momentum stays as it was (``B.cond`` branches in host memory, no extra pass)."""
        B = self.B
        m = self._momentum(g, st)
        finite = B.all_finite(m)
        old = st.momentum
        st.momentum = B.cond(finite, lambda: m, lambda: old)
        return self._encode(zero_nonfinite(B, m, finite), meta, st, noise, nan_flag(B, finite, g))

    def aggregate(self, received, enc: Encoded, out=None):
        if not self.vote:
            return super().aggregate(received, enc, out)
        B, meta = self.B, enc.meta
        total = None
        factor = float(len(received))
        for p in received:
            d = self._decode(p, meta, enc.ctx)
            total = d if total is None else B.iadd(total, d)  # decoded arrays are fresh
            # a rank's NaN scale (a non-finite step) makes the factor NaN: the sign of a
            # NaN sum need not be NaN, and this costs no pass over the tensor
            factor = factor + B.bitcast(p[:4], "float32")[0] * 0.0
        return self._finish(B.imul(B.isign(total), factor), meta, out)
