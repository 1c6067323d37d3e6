"""Quantizers: the value codecs and the whole-tensor compressors built on them.

A *codec* turns a flat float32 vector into named payload fields (a layout of
:class:`~hvd_compress.core.bitpack.Segment`) and back.  The same codec encodes
a whole tensor (``qsgd``) or the values a sparsifier kept (``topk+qsgd``).

Field layouts (in payload order; ``n`` values, bucket ``d``):

=========  ==================================================================
codec      fields
=========  ==================================================================
fp16       values float16[n]
bf16       values uint16[n] (bfloat16 bit patterns, round to nearest even)
qsgd       norms float32[ceil(n/d)], codes ceil(log2(2s+1))-bit x n
terngrad   scale float32[1], codes 2-bit x n (0 -> 0, 1 -> +1, 2 -> -1)
onebit     pos float32[cols], neg float32[cols], signs 1-bit x n (1: >= 0)
threshold  scale float32[1] (= tau), codes 2-bit x n (0 -> 0, 1 -> +tau, 2 -> -tau)
=========  ==================================================================

Sums that set a scale (norms, standard deviation, column means) are computed
in float64 and rounded to float32, so that every framework gets the same bits.

The codecs hold only this reference chain of array operations.  A backend may
run a whole quantizer step faster (:meth:`QuantizerCompressor._encode_fused`,
through ``B.fused_encoder``); the helpers that turn sums into scales
(:meth:`QSGDCodec.scales`, :meth:`TernGradCodec.sigma`, :meth:`OneBitCodec.means`)
are public so that such a fast path derives them exactly as the chain does.
"""

from __future__ import annotations

import math

from . import layout as layouts
from .base import Compressor, Encoded, host_nonfinite, kept_state, nan_flag
from .bitpack import Segment, join_segments, pack_codes, split_segments, unpack_values
from .table import defaults


def _flagged(x, flag):
    """``x`` times the finiteness flag (None: known finite, nothing to do)."""
    return x if flag is None else x * flag


def _norm64(B, x, axis=None):
    """Euclidean norm with float64 accumulation (no overflow for huge float32 values), float32."""
    return B.cast(B.sqrt(B.sumsq64(x, axis=axis)), "float32")


class Codec:
    """Encodes a flat float32 vector of ``n`` values (``cols`` columns, row-major)."""

    name = "codec"
    needs_noise = False
    #: whether values are coded column by column of the tensor's matrix view (1-bit's
    #: per-column means; :func:`columns`)
    columnwise = False
    #: whether payloads add up as they are (16-bit floats): a sparsifier whose indices
    #: every rank shares then sends the coded values by allreduce
    summable = False
    #: whether codes can be summed as integers against a scale every rank shares
    #: (``sum=int``, :mod:`.intsum`): such a codec implements the ``int_*`` hooks below
    int_summable = False
    #: the integer sum's aggregate is the sign of the summed codes (a majority vote)
    int_vote = False

    def __init__(self, params: dict):
        self.params = params

    def layout(self, n: int, cols: int = 1) -> list:
        raise NotImplementedError

    def encode_values(self, B, v, flag, noise, cols: int = 1) -> dict:
        """Payload fields for ``v`` (``flag``: None, or the 0-d 1/NaN that float fields are
        multiplied by; ``noise``: uniform [0, 1) per value, for the stochastic codecs)."""
        raise NotImplementedError

    def decode_values(self, B, fields: dict, n: int, cols: int = 1):
        raise NotImplementedError

    def nbytes(self, n: int, cols: int = 1) -> int:
        return sum(seg.nbytes for seg in self.layout(n, cols))

    # -- the integer-sum form (``sum=int``; :mod:`.intsum` runs the rounds) ------------------
    @property
    def int_max_code(self) -> int:
        """``m``: codes are integers in ``[-m, m]``."""
        return 1

    def int_scale_count(self, n: int) -> int:
        """How many scales ``n`` values share (round 0's payload, float32)."""
        return 1

    def int_bucket(self, n: int) -> int:
        """How many consecutive values share one scale."""
        return n

    def int_magnitudes(self, B, v):
        """What is quantized (from the finite values ``v``), or None."""
        raise NotImplementedError(f"{self.name} has no integer sum")

    def int_scales(self, B, v, mag):
        """This rank's scales (float32), reduced by max over ranks."""
        raise NotImplementedError(f"{self.name} has no integer sum")

    def int_unit(self, B, shared):
        """What a code is worth against the ``shared`` scales (None: 1)."""
        raise NotImplementedError(f"{self.name} has no integer sum")

    def int_levels(self, B, v, mag, noise, shared):
        """Each value's code magnitude (uint8) against the ``shared`` scales."""
        raise NotImplementedError(f"{self.name} has no integer sum")


class FP16Codec(Codec):
    """IEEE half precision (round to nearest even), as Horovod's ``Compression.fp16``."""

    name = "fp16"
    summable = True

    def layout(self, n, cols=1):
        return [Segment("values", "float16", n)]

    def encode_values(self, B, v, flag, noise, cols=1):
        return {"values": B.cast(_flagged(v, flag), "float16")}

    def decode_values(self, B, fields, n, cols=1):
        return B.cast(fields["values"], "float32")


class BF16Codec(Codec):
    """bfloat16: the top 16 bits of float32, rounded to nearest even."""

    name = "bf16"
    summable = True

    def layout(self, n, cols=1):
        return [Segment("values", "uint16", n)]

    def encode_values(self, B, v, flag, noise, cols=1):
        return {"values": B.to_bfloat16_bits(_flagged(v, flag))}

    def decode_values(self, B, fields, n, cols=1):
        return B.from_bfloat16_bits(fields["values"])


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
        table = B.asarray([0.0, 1.0, -1.0, 0.0], "float32", like=fields["scale"]) * fields["scale"]
        return unpack_values(B, fields["codes"], 2, n, table)

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


class OneBitCodec(Codec):
    """1-bit SGD (Seide et al., Interspeech 2014).

    The values, seen as a ``rows x cols`` matrix, are sent as one sign bit
    each; column ``c`` is reconstructed as the mean of its non-negative values
    (bit 1) or of its negative values (bit 0).  Meant to be used with error
    feedback, which carries the quantization error into the next step.
    """

    name = "onebit"
    columnwise = True

    def layout(self, n, cols=1):
        return [Segment("pos", "float32", cols), Segment("neg", "float32", cols),
                Segment("signs", "uint8", -(-n // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        axis = None if cols == 1 else 0  # whole-vector reductions are the fast ones
        m = v if cols == 1 else B.reshape(v, (-1, cols))
        nonneg = m >= 0
        npos = B.count_nonzero(nonneg, axis=axis)
        total = B.sum64(m, axis=axis)
        spos = B.sum64(B.maximum(m, 0.0), axis=axis)
        pos, neg = self.means(B, npos, spos, total - spos, B.shape(v)[0] // cols, cols)
        return {"pos": _flagged(pos, flag), "neg": _flagged(neg, flag),
                "signs": pack_codes(B, B.reshape(nonneg, (-1,)), 1)}

    @staticmethod
    def means(B, npos, spos, sneg, rows: int, cols: int):
        """``(pos, neg)``, float32[cols]: each column's mean of its non-negative values and
        of its negative ones (0 where there are none), from the count ``npos`` (int64) of
        the former and the float64 sums ``spos``, ``sneg`` of both, per column."""
        nneg = rows - npos
        npos64, nneg64 = B.cast(npos, "float64"), B.cast(nneg, "float64")
        pos = B.cast(B.where(npos > 0, B.div(spos, B.maximum(npos64, 1.0)), 0.0), "float32")
        neg = B.cast(B.where(nneg > 0, B.div(sneg, B.maximum(nneg64, 1.0)), 0.0), "float32")
        return B.reshape(pos, (cols,)), B.reshape(neg, (cols,))

    def decode_values(self, B, fields, n, cols=1):
        if cols == 1:  # one look-up: bit 1 -> pos, bit 0 -> neg
            table = B.concat([B.reshape(fields["neg"], (1,)), B.reshape(fields["pos"], (1,))])
            return unpack_values(B, fields["signs"], 1, n, table)
        fused = B.fused_unpack(fields["signs"], 1, n, B.concat([fields["neg"], fields["pos"]]), cols=cols)
        if fused is not None:
            return fused
        bits = B.reshape(unpack_values(B, fields["signs"], 1, n, [0.0, 1.0]), (-1, cols))
        pos = B.reshape(fields["pos"], (1, cols))
        neg = B.reshape(fields["neg"], (1, cols))
        return B.reshape(B.where(bits > 0.5, pos, neg), (-1,))


class ThresholdCodec(Codec):
    """2-bit threshold quantization (Strom, Interspeech 2015; MXNet's ``2bit``).

    Values ``>= tau`` are sent as ``+tau``, values ``<= -tau`` as ``-tau``, the
    rest as 0; with error feedback the remainder stays in the residual.
    """

    name = "threshold"

    @property
    def tau(self) -> float:
        return float(self.params["tau"])

    def layout(self, n, cols=1):
        return [Segment("scale", "float32", 1), Segment("codes", "uint8", -(-n * 2 // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        tau = self.tau
        code = B.iadd(B.cast(v >= tau, "uint8"), B.imul(B.cast(v <= -tau, "uint8"), 2))
        scale = B.reshape(_flagged(B.scalar(tau, like=v), flag), (1,))
        return {"scale": scale, "codes": pack_codes(B, code, 2)}

    def decode_values(self, B, fields, n, cols=1):
        # the four code values times the scale, then one look-up per byte
        table = B.asarray([0.0, 1.0, -1.0, 0.0], "float32", like=fields["scale"]) * fields["scale"]
        return unpack_values(B, fields["codes"], 2, n, table)


CODECS = {c.name: c for c in (FP16Codec, BF16Codec, QSGDCodec, TernGradCodec, OneBitCodec,
                              ThresholdCodec)}


def make_codec(name: str, params: dict) -> Codec:
    """The codec ``name`` with ``params`` completed by the registry's defaults."""
    return CODECS[name]({**defaults(name), **params})


def columns(meta, layout: str = layouts.OUT_FIRST) -> int:
    """Columns of the ``out x in`` matrix a tensor stored in ``layout`` makes, its input
    features, for column-wise codecs (1-bit); 1 for a vector (:mod:`.layout`)."""
    return layouts.input_features(meta.shape, layout)


class NoiseSource:
    """Uniform [0, 1) noise from a generator the compressor owns, seeded by (seed, rank)."""

    def __init__(self, B, seed: int, rank: int):
        self.B = B
        self.seed = seed
        self.rank = rank
        self.gen = B.generator(_mix(seed, rank))

    def draw(self, n: int, like=None):
        return self.B.uniform(self.gen, n, like=like)

    def key(self, like=None) -> int:
        """One 64-bit key from the generator, for a host fast path that hashes each
        element's index under it instead of drawing ``n`` values (TernGrad, QSGD)."""
        return self.B.random_key(self.gen, like=like)

    def state(self):
        return self.B.generator_state(self.gen)

    def load(self, state):
        self.B.set_generator_state(self.gen, state)


def _mix(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank * 7919 + 12345) & 0x7FFFFFFF


class QuantizerCompressor(Compressor):
    """A whole tensor through one codec; payload bytes travel by allgather."""

    fresh_decode = True  # every codec's decode (chain or kernel) makes its own array

    def __init__(self, codec_name: str, params=None, backend=None, rank=0, world_size=1, **kw):
        from .backend import NUMPY
        super().__init__(params, backend or NUMPY, rank, world_size)
        self.name = codec_name
        self.codec = make_codec(codec_name, self.params)
        self.noise = NoiseSource(self.B, int(self.params["seed"]), rank) \
            if self.codec.needs_noise else None

    def _cols(self, meta):
        return columns(meta, layouts.layout_of(self.B)) if self.codec.columnwise else 1

    def _flatten(self, x, meta):
        """Column-wise codecs see the values in ``out x in`` order whatever the layout
        (TensorFlow's kernels are transposed into it, and back in :meth:`_finish`), so
        that a column is an input feature in every framework; so are the residual and the
        payload's bits ordered."""
        flat = super()._flatten(x, meta)
        if self._cols(meta) == 1:
            return flat
        return layouts.to_out_first(self.B, flat, meta.shape, layouts.layout_of(self.B))

    def _finish(self, flat, meta, out=None):
        if self._cols(meta) != 1:
            flat = layouts.from_out_first(self.B, flat, meta.shape, layouts.layout_of(self.B))
        return super()._finish(flat, meta, out)

    def payload_nbytes(self, meta) -> int:
        return self.codec.nbytes(meta.numel, self._cols(meta))

    def _encode(self, v, meta, st, noise, flag) -> Encoded:
        B = self.B
        n = meta.numel
        if self.codec.needs_noise and noise is None:
            noise = self.noise.draw(n, like=v)
        elif noise is not None:
            noise = B.reshape(B.cast(noise, "float32"), (-1,))
        cols = self._cols(meta)
        fields = self.codec.encode_values(B, v, flag, noise, cols)
        payload = join_segments(B, self.codec.layout(n, cols), fields)
        return Encoded(payload, meta, self.payload_nbytes(meta))

    def _encode_fused(self, g, meta, st, noise) -> Encoded | None:
        """The whole step -- error feedback, statistics, codes, new residual, finiteness --
        as the backend's fused encoder (``B.fused_encoder``: compiled kernels for host
        memory, compiled ops for TensorFlow on CPU), or None where it has none.  The only
        place the core asks for a fused encoder (decoding asks ``B.fused_unpack``); the
        contract is ``NumpyBackend.fused_encoder``'s."""
        B = self.B
        cols = self._cols(meta)
        fused = B.fused_encoder(self.codec, cols, like=g)
        if fused is None:
            return None
        if noise is not None:
            noise = B.reshape(B.cast(noise, "float32"), (-1,))
        fields, residual, finite = fused(g, st.residual if self.ef else None, noise, self.noise)
        layout = self.codec.layout(meta.numel, cols)
        if host_nonfinite(finite):  # host, NaN/Inf: the state is as the reference leaves it
            return self._encode_host_nonfinite(g, meta, st, noise)
        if finite is not True:  # a 0-d tensor (device): no branch on its value
            flag = nan_flag(B, finite, g)
            fields = {seg.name: _flagged(fields[seg.name], flag) if seg.dtype == "float32"
                      else fields[seg.name] for seg in layout}
        if self.ef:
            st.residual = kept_state(B, finite, residual, st.residual)
        return Encoded(join_segments(B, layout, fields), meta, self.payload_nbytes(meta))

    def _decode(self, payload, meta, ctx=None):
        n, cols = meta.numel, self._cols(meta)
        fields = split_segments(self.B, self.codec.layout(n, cols), payload)
        fused = self.B.fused_decoder(self.codec, cols, like=payload)
        if fused is not None:  # the backend's fast path: the chain's bits
            return fused(fields, n)
        return self.codec.decode_values(self.B, fields, n, cols)


class Identity(Compressor):
    """``none``: the tensor itself, summed by allreduce (32 bits per element)."""

    name = "none"
    summable = True
    passthrough = True

    def encode(self, x, name="", noise=None) -> Encoded:
        meta = self.meta_for(x, name)
        return Encoded(self.B.reshape(x, (-1,)), meta, self.payload_nbytes(meta))

    def payload_nbytes(self, meta):
        return meta.numel * {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[meta.dtype]

    def _decode(self, payload, meta, ctx=None):
        return payload

    def _finish(self, flat, meta, out=None):
        dense = self.B.reshape(flat, meta.shape)
        return dense if out is None else self.B.icopy(out, dense)


class Cast16(Compressor):
    """``fp16`` / ``bf16``: a 16-bit cast, summed by allreduce (Horovod's fp16 compression).

    Non-finite values pass through as they are (a cast keeps NaN and Inf).
    """

    summable = True

    def __init__(self, name: str, params=None, backend=None, rank=0, world_size=1):
        from .backend import NUMPY
        super().__init__(params, backend or NUMPY, rank, world_size)
        self.name = name
        self.codec = make_codec(name, {})

    def encode(self, x, name="", noise=None) -> Encoded:
        meta = self.meta_for(x, name)
        B = self.B
        v = B.cast(B.reshape(x, (-1,)), "float32")
        fields = self.codec.encode_values(B, v, None, None)
        return Encoded(fields["values"], meta, self.payload_nbytes(meta))

    def payload_nbytes(self, meta):
        return 2 * meta.numel

    def _decode(self, payload, meta, ctx=None):
        return self.codec.decode_values(self.B, {"values": payload}, 0)

    def decode(self, payload, meta, ctx=None, out=None):
        if out is not None and self.B.dtype_name(payload) == "float16" \
                and self.B.dtype_name(out) == "float32":
            # the widening in the copy into ``out``: one pass, and no float32 tensor of
            # the whole gradient made first; the same conversion, so the same bits (other
            # buffers go through float32 as before: NaN's bits differ by route)
            return self.B.icopy(out, self.B.reshape(payload, meta.shape))
        return super().decode(payload, meta, ctx, out)

    def reduce_pair(self, a, b):
        """Sum two 16-bit payloads: added in float32, rounded back to 16 bits."""
        B = self.B
        total = self._decode(a, None) + self._decode(b, None)
        return self.codec.encode_values(B, total, None, None)["values"]
