"""What a value codec is, and what every codec shares.

A *codec* turns a flat float32 vector into named payload fields (a layout of
:class:`~hvd_compress.core.bitpack.Segment`) and back.  The same codec encodes a
whole tensor (``qsgd``, through :class:`~.quantizers.QuantizerCompressor`) or the
values a sparsifier kept (``topk+qsgd``).  Each algorithm's codec lives in its own
module (:mod:`.qsgd`, :mod:`.terngrad`, :mod:`.onebit`, :mod:`.threshold`,
:mod:`.cast16`, :mod:`.signs`, :mod:`.levels`) with the flags that say what it needs
and, where its codes can be summed as integers, its integer-sum form (the ``int_*``
hooks :mod:`.intsum` asks for).

Sums that set a scale (norms, standard deviation, column means) are computed in
float64 and rounded to float32, so that every framework gets the same bits.
"""

from __future__ import annotations

from .table import defaults


def _flagged(x, flag):
    """``x`` times the finiteness flag (None: known finite, nothing to do)."""
    return x if flag is None else x * flag


def _ternary_table(B, scale):
    """``[0, +1, -1, 0] * scale`` (float32[4]) for 2-bit codes, from ``scale`` (float32[1])
    itself: the same float32 products as a table of constants times it (NaN and Inf
    included), with no host data copied to the scale's device (a synchronous copy)."""
    zero = scale * 0.0
    return B.concat([zero, scale * 1.0, scale * -1.0, zero])


def _norm64(B, x, axis=None):
    """Euclidean norm with float64 accumulation (no overflow for huge float32 values), float32."""
    return B.cast(B.sqrt(B.sumsq64(x, axis=axis)), "float32")


class Codec:
    """Encodes a flat float32 vector of ``n`` values (``cols`` columns, row-major)."""

    name = "codec"
    needs_noise = False
    #: whether values are coded column by column of the tensor's matrix view (1-bit's
    #: per-column means; :func:`.quantizers.columns`)
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


#: every codec by its spec name (filled as the codec modules are collected: by
#: :mod:`.quantizers` and :mod:`.registry`)
CODECS: dict = {}


def make_codec(name: str, params: dict) -> Codec:
    """The codec ``name`` with ``params`` completed by the registry's defaults."""
    return CODECS[name]({**defaults(name), **params})


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
