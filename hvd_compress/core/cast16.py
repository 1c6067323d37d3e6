"""16-bit casts summed by allreduce: ``fp16`` (IEEE half precision, as Horovod's
``Compression.fp16``) and ``bf16`` (bfloat16, sent as float16 since Horovod cannot
allreduce bfloat16).

Fields (``n`` values): ``fp16`` values float16[n]; ``bf16`` values uint16[n]
(bfloat16 bit patterns, rounded to nearest even).
"""

from __future__ import annotations

from .base import Compressor, Encoded
from .bitpack import Segment
from .codec import Codec, _flagged, make_codec


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
