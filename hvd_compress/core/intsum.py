"""Quantizers summed as integers (``terngrad:sum=int``, ``qsgd:sum=int``,
``signsgd:sum=int``): one allreduce whose bytes per worker do not grow with the
number of workers, where the allgather of packed codes grows as ``p - 1``.

A quantizer's codes can be added across ranks only if every rank quantizes
against the same scale.  So a step takes two allreduce rounds:

0. each rank's scales, float32, reduced by **max**: TernGrad's ``max|clip(v)|``
   (one per tensor: the paper's *scaler sharing*, Wen et al., NeurIPS 2017),
   QSGD's bucket norms (one per bucket of ``d``; Alistarh et al., NeurIPS 2017),
   nothing for signSGD (a 0 that only carries finiteness).  A rank whose values
   are not finite sends ``+inf``: every rank then sees ``inf`` (a NaN would not
   do: Horovod's max of a NaN depends on the order it meets it in);
1. integer codes ``c_i`` in ``[-m, m]`` against the shared scale, summed:

   - TernGrad: ``sign(v_i) * [u_i < |clip(v_i)| / S]``, ``m = 1``; unbiased for
     the clipped values, as the original, since ``S >= |clip(v_i)|`` on every rank;
   - QSGD: ``sign(v_i) * floor(s |v_i| / N_b + u_i)``, ``m = s``; unbiased, since
     ``N_b >= ||v_b|| >= |v_i|`` on every rank (the bound on the variance uses the
     shared norm, so it is looser than with the rank's own);
   - signSGD's majority vote (Bernstein et al., ICLR 2019): ``sign(v_i)``, ``m = 1``;
     the aggregate is ``sign(sum of signs)`` (``vote=false``: the sum, averaged by
     the engine).  A value of exactly 0 votes 0 here, where the 1-bit format has
     no 0 and counts it as + (an unused parameter: all 0, no vote either way).

   The aggregate is ``sum_r c_i * unit`` (TernGrad ``S``, QSGD ``N_b / s``).

**Lanes.**  Codes travel as signed digits in lanes of ``w`` bits packed into
int32 words -- Horovod 0.28.1's allreduce takes no 8- or 16-bit integers
(``ValueError: Tensor type torch.CharTensor is not supported``), so a word
carries ``32 / w`` lanes.  ``w`` is the narrowest of 4, 8, 16 and 32 bits with
``p * m <= 2**(w-1) - 1`` (:func:`lane_bits`): the sum of ``p`` codes of at most
``m`` in magnitude then fits a lane as a signed digit, so no lane's sum can reach
into the next.  A rank sends ``pack(c + h) - C`` (``h = 2**(w-1)``, ``C`` the word of
``h`` in every lane), which as an integer is ``sum_j c_j 2**(w j)``; words add as
integers modulo ``2**32`` (how every Horovod backend adds int32: a test checks
that a sum into the sign bit comes back wrapped), and ``W + C`` read as unsigned
lanes is ``sum_r c_j + h`` in lane ``j``.  So the receiver needs neither ``p`` nor
a rank's payload, and a payload's size depends only on ``n`` and ``w``: TernGrad
and signSGD take 4 bits a value up to 7 workers and 8 bits up to 127, QSGD with 7
levels 8 bits up to 18 workers and 16 bits up to 4,681.

Error feedback (``ef=true``; off by default, as the originals are unbiased) keeps
``v - c * unit`` once the shared scale is known.  A non-finite step (``inf`` among
the shared scales) decodes to NaN on every rank and leaves every rank's state as
it was: with one scale for all, no rank's codes mean anything that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Compressor, Encoded, nan_flag, zero_nonfinite
from .bitpack import pack_codes, packed_nbytes, unpack_values
from .codec import NoiseSource, make_codec
from .exchange import MAX

__all__ = ["IntegerSum", "lane_bits", "LANE_BITS"]

#: the lane widths a word is cut into, narrowest first
LANE_BITS = (4, 8, 16, 32)


def lane_bits(world_size: int, m: int) -> int:
    """The narrowest lane (bits) in which the sum of ``world_size`` codes in ``[-m, m]``
    fits as a signed digit: ``world_size * m <= 2**(w-1) - 1``."""
    for w in LANE_BITS:
        if world_size * m <= (1 << (w - 1)) - 1:
            return w
    raise ValueError(f"integer sums of codes up to {m} cannot hold {world_size} workers "
                     f"(at most {((1 << 31) - 1) // m:,})")


@dataclass
class Pending:
    """Round 0's context for round 1: the values ``v`` (finite, with the residual), what
    is quantized (``mag``; None on the host fast path), the noise or the key it is hashed
    under, finiteness, and the host fast path with TernGrad's clipping cap."""

    v: Any
    mag: Any
    noise: Any
    finite: Any
    fast: Any = None
    key: Any = None
    cap: Any = None


class _HostPasses:
    """What :meth:`~.backend.NumpyBackend.fused_encoder` is asked for: the host passes of
    the integer sums (``hvd_compress.accel.host_stochastic.IntSumHost``), or None."""

    name = "intsum"


_HOST = _HostPasses()


def _bias_word(w: int) -> int:
    """``C``: ``h = 2**(w-1)`` in every lane of a 32-bit word, as a signed int32."""
    word = sum((1 << (w - 1)) << (w * j) for j in range(32 // w))
    return word - (1 << 32) if word >= 1 << 31 else word


class IntegerSum(Compressor):
    """TernGrad, QSGD or signSGD with codes summed by allreduce; see the module
    docstring.  ``kind``: the spec name of a codec with an integer-sum form
    (``Codec.int_summable``: ``"terngrad"``, ``"qsgd"``, ``"signsgd"``), whose
    ``int_*`` hooks say what is quantized, against which scales, and what a code is
    worth; the rounds, the lanes and the state are this class's."""

    summable = True
    #: the payload cannot be averaged by Horovod's own allreduce (integers)
    integer_sum = True

    def __init__(self, params=None, backend=None, rank=0, world_size=1, kind="terngrad", **kw):
        from .backend import NUMPY
        super().__init__(params, backend or NUMPY, rank, world_size)
        self.name = kind
        self.kind = kind  # the spec name (tests' models of the codes read it; nothing dispatches on it)
        self.codec = make_codec(kind, self.params)
        if not self.codec.int_summable:
            raise ValueError(f"{kind}: its codes have no integer sum (sum=int)")
        self.m = int(self.codec.int_max_code)
        self.vote = bool(self.codec.int_vote)
        self.scale_free = self.vote
        self.w = lane_bits(world_size, self.m)
        self.noise = NoiseSource(self.B, int(self.params["seed"]), rank) \
            if self.codec.needs_noise else None

    @property
    def max_ranks(self) -> int:
        """The most ranks whose sums the lanes hold (the engine refuses more)."""
        return ((1 << (self.w - 1)) - 1) // self.m

    def rounds(self, meta) -> int:
        return 2

    def round_op(self, round_: int):
        """How round ``round_``'s payloads combine: the scales by max, then codes by sum."""
        return MAX if round_ == 0 else None

    # -- sizes ----------------------------------------------------------------------
    def _scale_count(self, numel: int) -> int:
        return self.codec.int_scale_count(numel)

    def _words(self, numel: int) -> int:
        return -(-numel * self.w // 32)

    def payload_nbytes(self, meta) -> int:
        """Both rounds: the scales (float32) and the code words (int32)."""
        return 4 * (self._scale_count(meta.numel) + self._words(meta.numel))

    # -- round 0: this rank's scales ----------------------------------------------------
    def encode(self, x, name="", noise=None) -> Encoded:
        meta = self.meta_for(x, name)
        B = self.B
        g = B.cast(B.reshape(x, (-1,)), "float32")
        st = self.state(meta, like=g)
        fast = None if self.ef else B.fused_encoder(_HOST, 1, like=g)
        got = None if fast is None else fast.scales(self, g)
        if got is not None:  # host memory, finite: one statistics pass, no noise drawn
            scales, cap = got
            key = None
            if noise is not None:
                noise = B.reshape(B.cast(noise, "float32"), (-1,))
            elif self.noise is not None:
                key = self.noise.key(like=g)
            st.step = st.step + 1
            return Encoded(scales, meta, 4 * B.shape(scales)[0], round=0,
                           ctx=Pending(g, None, noise, True, fast, key, cap))
        v = g + st.residual if self.ef else g
        finite = B.all_finite(v)
        clean = zero_nonfinite(B, v, finite)
        mag = self._magnitudes(clean)
        scales = self._scales(clean, mag)
        # a non-finite rank's scales are +inf: the max is then inf on every rank
        inf = B.where(finite, B.scalar(0.0, like=g), B.scalar(float("inf"), like=g))
        scales = B.reshape(scales + inf, (-1,))
        # given noise is kept for round 1; our own is drawn there, when it is used (a
        # backend may hand out one buffer for every draw: torch's host generator does)
        if self.noise is not None and noise is not None:
            noise = B.reshape(B.cast(noise, "float32"), (-1,))
        st.step = st.step + 1
        return Encoded(scales, meta, 4 * B.shape(scales)[0], round=0,
                       ctx=Pending(clean, mag, noise, finite))

    def _magnitudes(self, v):
        """What is quantized: ``|clip(v)|`` (TernGrad), ``|v|`` (QSGD), None (signSGD)."""
        return self.codec.int_magnitudes(self.B, v)

    def _scales(self, v, mag):
        return self.codec.int_scales(self.B, v, mag)

    # -- round 1: codes against the shared scale ---------------------------------------------
    def next_round(self, enc: Encoded, reduced) -> Encoded:
        B = self.B
        meta = enc.meta
        ctx, shared = enc.ctx, reduced
        unit = self._unit(shared)
        if ctx.fast is not None:
            words = ctx.fast.words(self, ctx.v, ctx.noise, ctx.key, shared, ctx.cap,
                                   self._words(meta.numel), _bias_word(self.w))
            return Encoded(words, meta, 4 * B.shape(words)[0], round=1, ctx=(shared, unit))
        v, finite = ctx.v, ctx.finite
        noise = ctx.noise
        if noise is None and self.noise is not None:
            noise = self.noise.draw(meta.numel, like=v)
        level = self._levels(v, ctx.mag, noise, shared)
        neg = B.cast(v < 0, "uint8")
        words = self._pack(level, neg, meta.numel)
        if self.ef:
            ok = B.all_finite(shared) & finite
            codes = B.cast(level, "float32") * (1.0 - 2.0 * B.cast(neg, "float32"))
            st = self.states[meta.name]
            old = st.residual
            st.residual = B.cond(ok, lambda: v - self._scaled(codes, unit), lambda: old)
        return Encoded(words, meta, 4 * B.shape(words)[0], round=1, ctx=(shared, unit))

    def _unit(self, shared):
        """What a code is worth: TernGrad ``S``, QSGD ``N_b / s`` per bucket, signSGD None."""
        return self.codec.int_unit(self.B, shared)

    def _levels(self, v, mag, noise, shared):
        """Each value's code magnitude (uint8; signSGD: ``v != 0``) against ``shared``."""
        return self.codec.int_levels(self.B, v, mag, noise, shared)

    def _scaled(self, x, unit):
        """Flat float32 code values ``x`` times their unit (a fresh ``x``: in place)."""
        if unit is None:
            return x
        return self.B.bucket_scale(x, unit, self.codec.int_bucket(self.B.shape(x)[0]))

    def _pack(self, level, neg, n: int):
        """Codes ``c = level * (1 - 2 [v < 0])`` as int32 words of signed digits: the
        biased codes ``c + h`` packed, minus ``C``."""
        B = self.B
        w = self.w
        if w <= 8:  # c + h = h + level - 2 * level * [v < 0], in [h - m, h + m]: uint8
            biased = B.isub(level + (1 << (w - 1)), neg * level * 2)
            data = pack_codes(B, biased, w)
            words = B.bitcast(B.pad_to(data, 4 * self._words(n)), "int32")
        else:
            codes = B.cast(level, "int32") - B.cast(neg * level, "int32") * 2
            if w == 32:
                return codes
            # two 16-bit lanes: lo + hi << 16 (into the sign bit: int32 wraps)
            pairs = B.reshape(B.pad_to(codes + (1 << 15), 2 * self._words(n)), (-1, 2))
            words = pairs[:, 0] + B.shift_left(pairs[:, 1], 16)
        return words - B.asarray([_bias_word(w)], "int32", like=words)

    def lanes(self, words, n: int):
        """The lane sums (float32, ``n`` of them) in summed words: ``W + C`` read as
        unsigned lanes, minus ``h``."""
        B = self.B
        w = self.w
        if w == 32:
            return B.cast(words, "float32")
        h = float(1 << (w - 1))
        unbiased = words + B.asarray([_bias_word(w)], "int32", like=words)
        if w <= 8:
            return unpack_values(B, B.bitcast(unbiased, "uint8")[:packed_nbytes(n, w)], w, n,
                                 [float(e) - h for e in range(1 << w)])
        lo = B.bit_and(unbiased, 0xFFFF)
        hi = B.bit_and(B.shift_right(unbiased, 16), 0xFFFF)
        both = B.reshape(B.transpose(B.reshape(B.concat([lo, hi]), (2, -1))), (-1,))
        return B.cast(both[:n], "float32") - h

    # -- the sum ------------------------------------------------------------------------
    def aggregate(self, received, enc: Encoded, out=None):
        B = self.B
        meta = enc.meta
        shared, unit = enc.ctx
        received = B.reshape(received, (-1,))
        fast = B.fused_encoder(_HOST, 1, like=received)
        if fast is not None and bool(B.all_finite(shared)):  # host memory: one pass
            target = self._flat_out(out, meta)
            flat = fast.lanes(self, received, meta.numel, None if self.vote else unit,
                              _bias_word(self.w), None if target is None else B.host_view(target))
            return out if target is not None else self._finish(B.from_host(flat), meta, out)
        total = self.lanes(received, meta.numel)
        ok = B.all_finite(shared)  # else a rank's values were not finite: NaN throughout
        total = B.cond(ok, lambda: B.isign(total) if self.vote else self._scaled(total, unit),
                       lambda: total * nan_flag(B, ok, total))
        return self._finish(total, meta, out)

    def wire(self, payload):
        return payload  # int32 words and float32 scales: Horovod adds both as they are

    def decode(self, payload, meta, ctx=None, out=None):
        raise NotImplementedError(f"{self.name}:sum=int decodes sums of both rounds; use aggregate()")

