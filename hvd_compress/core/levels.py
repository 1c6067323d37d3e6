"""Value codecs that round each element to one of a fixed set of levels: natural
compression, uniform max-min quantization and Dettmers' 8-bit approximation.

Field layouts (``n`` values, bucket ``d``, ``b`` bits):

=========  ==================================================================
codec      fields
=========  ==================================================================
natural    exps uint8[n] (float32 exponent field), signs 1-bit x n (1: negative)
uniform    mins float32[ceil(n/d)], scales float32[ceil(n/d)], codes b-bit x n
eightbit   scale float32[1] (max |v|), codes uint8[n] (index into the 256 levels)
sketchml   means float32[q], codes uint8[n] (q <= 256) or uint16[n] (bucket index)
=========  ==================================================================
"""

from __future__ import annotations

import numpy as np

from .bitpack import Segment, pack_codes, unpack_values
from .codec import Codec, _flagged


def _by_bucket(B, v, d: int, fn, *per_bucket):
    """``fn(block, *columns)`` over the buckets of ``d`` values of flat ``v`` (the last
    may be shorter): ``block`` is a ``rows x d`` view, each column the per-bucket values
    as ``rows x 1``; returns the flat result."""
    n = B.shape(v)[0]
    full = n // d
    parts = []
    if full:
        cols = [B.reshape(a[:full], (full, 1)) for a in per_bucket]
        parts.append(B.reshape(fn(B.reshape(v[:full * d], (full, d)), *cols), (-1,)))
    if n % d:
        cols = [B.reshape(a[full:full + 1], (1, 1)) for a in per_bucket]
        parts.append(B.reshape(fn(B.reshape(v[full * d:], (1, -1)), *cols), (-1,)))
    return parts[0] if len(parts) == 1 else B.concat(parts)


def _bucket_max(B, v, d: int):
    """The maximum of each bucket of ``d`` values (float32[ceil(n/d)])."""
    n = B.shape(v)[0]
    full = n // d
    parts = [B.max(B.reshape(v[:full * d], (full, d)), axis=1)] if full else []
    if n % d:
        parts.append(B.reshape(B.max(v[full * d:]), (1,)))
    return parts[0] if len(parts) == 1 else B.concat(parts)


def _poison_codes(B, codes, flag, value: int):
    """Integer ``codes`` (int32) set to ``value`` everywhere when ``flag`` is NaN (a
    non-finite step); a codec without float fields carries NaN this way."""
    if flag is None:
        return codes
    bad = 1 - B.cast(B.isfinite(flag), "int32")
    return codes + (value - codes) * bad


class NaturalCodec(Codec):
    """Natural compression (Horvath et al., 2019, "Natural Compression for Distributed
    Deep Learning"): each value is rounded at random to one of the two powers of two
    around it, ``2^e <= |v| < 2^(e+1)``, up with probability ``|v|/2^e - 1``: unbiased.

    With ``v``'s float32 bits this is the exponent field ``E`` rounded up with
    probability ``mantissa / 2^23`` (subnormals round to 0 or ``2^-126`` the same way,
    unbiased too), so a value travels as its sign and its 8-bit exponent: 9 bits.
    ``E`` = 0 decodes to 0; a value of ``2^127`` or more that would round up to the
    infinity exponent stays at ``2^127`` (the one biased case).  Exponent 255 marks a
    non-finite step (decodes to NaN).  GRACE keeps 7 exponent bits (2^-108 .. 2^18)
    in one byte; we keep float32's whole range.
    """

    name = "natural"
    needs_noise = True
    #: the value of each exponent code (0: zero, 255: NaN)
    powers = np.asarray([0.0] + [2.0 ** (e - 127) for e in range(1, 255)] + [np.nan], np.float32)

    def layout(self, n, cols=1):
        return [Segment("exps", "uint8", n), Segment("signs", "uint8", -(-n // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        bits = B.bitcast(v, "int32")
        exp = B.bit_and(B.shift_right(bits, 23), 0xFF)
        prob = B.cast(B.bit_and(bits, 0x7FFFFF), "float32") * float(2.0 ** -23)
        exp = B.minimum(exp + B.cast(noise < prob, "int32"), 254)
        exps = B.cast(_poison_codes(B, exp, flag, 255), "uint8")
        return {"exps": exps, "signs": pack_codes(B, bits < 0, 1)}

    def decode_values(self, B, fields, n, cols=1):
        table = B.asarray(self.powers, "float32", like=fields["signs"])
        mags = B.lookup(table, fields["exps"])
        return mags * unpack_values(B, fields["signs"], 1, n, [1.0, -1.0])


_LARGEST_RANGE = 2.0 ** 128 * (1.0 - 2.0 ** -20)  # below float32's largest, with a margin


class UniformCodec(Codec):
    """Uniform max-min quantization with buckets (CGX, Markov et al. 2022; Bagua's
    ByteGrad): in each bucket of ``d`` values, ``lo = min``, ``scale = (max - lo) /
    (2^b - 1)``, and a value becomes ``lo + scale * code`` with ``code`` in ``[0,
    2^b - 1]``: ``floor((v - lo)/scale + u)``, ``u ~ U[0, 1)`` (``stochastic``,
    unbiased), or rounded to the nearest level.  Defaults are CGX's: 4 bits, buckets
    of 512.  The range is taken in float64, so huge values do not overflow it.
    """

    name = "uniform"

    def __init__(self, params):
        super().__init__(params)
        self.bits = int(params["bits"])
        self.d = int(params["bucket"])
        self.needs_noise = bool(params["stochastic"])
        if not 1 <= self.bits <= 8:
            raise ValueError(f"uniform: bits must be in [1, 8], got {self.bits}")
        self.levels = (1 << self.bits) - 1

    def layout(self, n, cols=1):
        nb = -(-n // self.d)
        return [Segment("mins", "float32", nb), Segment("scales", "float32", nb),
                Segment("codes", "uint8", -(-n * self.bits // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        d, L = self.d, float(self.levels)
        lo = -_bucket_max(B, -v, d)
        scale, inv = self.scales(B, lo, _bucket_max(B, v, d))
        x = B.clip(_by_bucket(B, v, d, lambda blk, a, b: blk * a - b, inv, lo * inv), 0.0, L)
        x = B.floor(x + noise) if self.needs_noise else B.floor(x + 0.5)
        code = B.cast(B.minimum(x, L), "uint8")
        return {"mins": _flagged(lo, flag), "scales": _flagged(scale, flag),
                "codes": pack_codes(B, code, self.bits)}

    def scales(self, B, lo, hi):
        """``(scale, inv)`` per bucket from its min and max: ``(hi - lo) / L`` and ``L / (hi
        - lo)`` (0 for a constant bucket), from the range in float64, as float32.

        The range is kept within ``[L * 2^-126, 2^128 * (1 - 2^-20)]`` so that neither
        ``inv`` nor a decoded ``code * scale`` leaves float32's finite range: a bucket
        narrower than that is quantized on steps of ``2^-126`` (still unbiased when
        stochastic; the absolute error below ``2^-126``), and one wider (values
        beyond +-1.7e38 of both signs) is clipped at ``lo + 3.4e38`` (finite; error
        feedback keeps the difference)."""
        L = float(self.levels)
        rng = B.cast(hi, "float64") - B.cast(lo, "float64")
        rng = B.where(rng > 0, B.minimum(B.maximum(rng, L * 2.0 ** -126), _LARGEST_RANGE), rng)
        scale = B.cast(B.div(rng, L), "float32")
        inv = B.cast(B.where(rng > 0, B.div(L, B.where(rng > 0, rng, 1.0)), 0.0), "float32")
        return scale, inv

    def decode_values(self, B, fields, n, cols=1):
        steps = unpack_values(B, fields["codes"], self.bits, n,
                              [float(c) for c in range(1 << self.bits)], factors=fields["scales"],
                              d=self.d)
        return _by_bucket(B, steps, self.d, lambda blk, lo: blk + lo, fields["mins"])


def dynamic_tree_levels() -> np.ndarray:
    """The 256 levels of Dettmers' dynamic tree data type, sorted (float32).

    Sign, then exponent ``10^-k`` for ``k = 6 .. 0`` with ``2^(6-k)`` linear fraction
    levels each (the midpoints of ``[0.1, 1]`` cut in that many pieces), plus 0 and 1:
    127 magnitudes of each sign, 0 and 1.  This is the construction of
    bitsandbytes' ``create_dynamic_map`` (signed, 7 exponent bits), Dettmers' own
    implementation of the type."""
    mags = []
    for i in range(7):
        edges = np.linspace(0.1, 1.0, 2 ** i + 1)
        mags.extend((10.0 ** (i - 6)) * (edges[:-1] + edges[1:]) / 2.0)
    mags = np.asarray(mags)
    return np.sort(np.concatenate([-mags, mags, [0.0, 1.0]])).astype(np.float32)


_TREE = dynamic_tree_levels()
#: the rounding boundaries: midpoints of neighbouring levels (float32)
_TREE_EDGES = ((_TREE[:-1].astype(np.float64) + _TREE[1:]) / 2.0).astype(np.float32)


class EightBitCodec(Codec):
    """8-bit approximation (Dettmers, ICLR 2016, "8-Bit Approximations for Parallelism
    in Deep Learning"): values divided by the tensor's ``max |v|`` (at least
    ``2^-126``) and rounded to the nearest of the dynamic tree type's 256 levels
    (:func:`dynamic_tree_levels`: fine near 0, coarse near 1, relative error about
    1-10%).  Deterministic and biased;
    ``ef=true`` keeps the rounding error.  GRACE's ``u8bit`` uses a table of its own
    and rounds down to a level; we round to the nearest, as bitsandbytes does.
    """

    name = "eightbit"
    levels = _TREE
    edges = _TREE_EDGES

    def layout(self, n, cols=1):
        return [Segment("scale", "float32", 1), Segment("codes", "uint8", n)]

    @staticmethod
    def scale(B, v):
        """The scale sent: ``max |v|``, at least ``2^-126`` (so that ``1 / scale`` is a
        finite float32; a tensor of subnormals is then rounded on a grid as fine as
        the type's near 0), 0 for an all-zero tensor."""
        s = B.absmax(v)
        return B.where(s > 0, B.maximum(s, 2.0 ** -126), s)

    @staticmethod
    def inverse(B, s):
        """``1 / s`` for the scale ``s`` (0 when ``s`` is 0)."""
        return B.where(s > 0, B.div(1.0, B.where(s > 0, s, 1.0)), 0.0)

    def encode_values(self, B, v, flag, noise, cols=1):
        s = self.scale(B, v)
        inv = self.inverse(B, s)
        edges = B.asarray(self.edges, "float32", like=v)
        code = B.cast(B.bucketize(v * inv, edges), "uint8")
        return {"scale": B.reshape(_flagged(B.cast(s, "float32"), flag), (1,)), "codes": code}

    def decode_values(self, B, fields, n, cols=1):
        table = B.asarray(self.levels, "float32", like=fields["scale"])
        return B.lookup(table, fields["codes"]) * fields["scale"]


class SketchMLCodec(Codec):
    """SketchML's quantile buckets (Jiang et al., SIGMOD 2018, "SketchML: Accelerating
    Distributed Machine Learning with Data Sketches"): the values' ``q`` quantiles cut
    them into ``q`` buckets of about equal count; each value is sent as its bucket's
    index (8 bits for ``q`` <= 256, else 16) and each bucket as the mean of its values.

    The paper keeps a quantile sketch; here the quantiles are taken exactly from a
    strided sample of at most ``sample`` values (every value when the tensor is no
    larger): sorted, its values at ranks ``j*m/q``, ``j = 1 .. q-1``, are the bucket
    edges, and a value goes to the bucket of how many edges are ``<=`` it.  No
    arithmetic touches the edges, so every framework cuts the same buckets; the
    means are float64 sums over float64 counts, as float32.  An empty bucket's mean
    is 0.  The paper's MinMaxSketch of the keys (sparse gradients) has no part in a
    dense tensor.  Deterministic and biased (a bucket's mean); ``ef=true`` keeps the
    error.
    """

    name = "sketchml"

    def __init__(self, params):
        super().__init__(params)
        self.q = int(params["buckets"])
        self.sample = int(params["sample"])
        self.code_dtype = "uint8" if self.q <= 256 else "uint16"

    def layout(self, n, cols=1):
        return [Segment("means", "float32", self.q), Segment("codes", self.code_dtype, n)]

    def edges(self, B, v):
        """The ``q - 1`` inner bucket edges of ``v`` (float32, sorted)."""
        n = B.shape(v)[0]
        m = min(n, self.sample)
        sample = v if m == n else B.gather(v, B.asarray(
            [i * n // m for i in range(m)], "int64", like=v))
        ranks = [j * m // self.q for j in range(1, self.q)]
        return B.gather(B.sort(sample), B.asarray(ranks, "int64", like=v))

    def encode_values(self, B, v, flag, noise, cols=1):
        code = B.bucketize(v, self.edges(B, v))
        sums = B.scatter_add(self.q, code, B.cast(v, "float64"), "float64")
        counts = B.scatter_add(self.q, code, B.full(B.shape(v), 1.0, "float64", like=v), "float64")
        means = self.means(B, sums, counts)
        return {"means": _flagged(means, flag), "codes": B.cast(code, self.code_dtype)}

    @staticmethod
    def means(B, sums, counts):
        """Each bucket's mean (float32; 0 when empty) from its float64 sum and count."""
        return B.cast(B.where(counts > 0, B.div(sums, B.maximum(counts, 1.0)), 0.0), "float32")

    def decode_values(self, B, fields, n, cols=1):
        return B.lookup(fields["means"], fields["codes"])
