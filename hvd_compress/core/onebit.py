"""1-bit SGD (Seide et al., Interspeech 2014): its codec.

Fields (``n`` values, ``cols`` columns): ``pos float32[cols]``, ``neg float32[cols]``,
then ``signs``, 1 bit per value (1: ``>= 0``).  The values are seen column by column
(``columnwise``); :meth:`OneBitCodec.means` is public so that a fast path derives the
column means exactly as the chain does.
"""

from __future__ import annotations

from .bitpack import Segment, pack_codes, unpack_values
from .codec import Codec, _flagged


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
