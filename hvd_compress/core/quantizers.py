"""Whole-tensor quantizers: a tensor through one value codec, its payload by allgather.

:class:`QuantizerCompressor` runs any codec (:mod:`.codec`) over a whole tensor:
error feedback, the codec's fields joined into one payload, decoding every rank's.
The codecs live each in its algorithm's module -- :mod:`.qsgd`, :mod:`.terngrad`,
:mod:`.onebit`, :mod:`.threshold`, :mod:`.cast16` (``fp16``, ``bf16``), :mod:`.signs`,
:mod:`.levels` -- and ``none`` in :mod:`.identity`; their names are importable from
here as well.

The codecs hold only the reference chain of array operations.  A backend may run a
whole quantizer step faster (:meth:`QuantizerCompressor._encode_fused`, through
``B.fused_encoder``).
"""

from __future__ import annotations

from . import layout as layouts
from .base import Compressor, Encoded, host_nonfinite, kept_state, nan_flag
from .bitpack import join_segments, split_segments
from .cast16 import BF16Codec, Cast16, FP16Codec
from .codec import CODECS, Codec, NoiseSource, _flagged, _mix, _norm64, make_codec
from .identity import Identity
from .onebit import OneBitCodec
from .qsgd import QSGDCodec
from .terngrad import TernGradCodec
from .threshold import ThresholdCodec

__all__ = ["Codec", "CODECS", "make_codec", "NoiseSource", "columns", "QuantizerCompressor",
           "Identity", "Cast16", "FP16Codec", "BF16Codec", "QSGDCodec", "TernGradCodec",
           "OneBitCodec", "ThresholdCodec", "_flagged", "_mix", "_norm64"]

CODECS.update({c.name: c for c in (FP16Codec, BF16Codec, QSGDCodec, TernGradCodec, OneBitCodec,
                                   ThresholdCodec)})


def columns(meta, layout: str = layouts.OUT_FIRST) -> int:
    """Columns of the ``out x in`` matrix a tensor stored in ``layout`` makes, its input
    features, for column-wise codecs (1-bit); 1 for a vector (:mod:`.layout`)."""
    return layouts.input_features(meta.shape, layout)


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
