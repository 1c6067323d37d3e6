"""``none``: the tensor itself, summed (averaged) by allreduce as Horovod does."""

from __future__ import annotations

from .base import Compressor, Encoded


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
