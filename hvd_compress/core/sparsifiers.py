"""Sparsifiers: top-k, random-k, and their composition with a value codec.

Payload layout (``k`` kept values of a tensor with ``n`` elements)::

    topk          indices int32[k] (int64 when n >= 2**31), values float32[k]
    randomk       values float32[k]            (indices shared, not sent; allreduce)
    S+codec       indices (unless S is randomk), then the codec's fields for k values

Indices are sent in increasing order.  A slot that selection could not fill
(only DGC, when fewer than k values pass its threshold) carries index 0 and
value 0, which adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .base import Compressor, Encoded, PayloadFastPath, host_nonfinite, kept_state
from .bitpack import Segment, join_segments, split_segments
from .codec import NoiseSource, make_codec
from .sampling import stratified_indices, stream_keys

PURPOSE_RANDOMK = 1
PURPOSE_DGC_SAMPLE = 2


def index_dtype(n: int) -> str:
    return "int32" if n < 2 ** 31 else "int64"


def count_for(ratio: float, n: int) -> int:
    """k = ceil(ratio * n), at least 1 and at most n."""
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))


def topk_indices(B, mag, k: int):
    """Indices (increasing) of exactly the k largest entries of ``mag``; ties go to the
    lower index.  This canonical choice makes every framework pick the same set.  A
    backend may select it faster itself (``B.top_indices``, None where it cannot)."""
    idx = B.top_indices(mag, k)
    if idx is not None:
        return idx
    t = B.kth_largest(mag, k)
    if B.is_host(mag):  # few candidates: collect them directly
        above = B.nonzero(mag > t)
        equal = B.nonzero(mag == t)[:k - B.shape(above)[0]]
        return B.sort(B.concat([above, equal]))
    # static shapes: the entries above t, then the first `room` entries equal to t
    # (compact pads with n, which sorts last)
    above = mag > t
    room = k - B.count_nonzero(above)
    n = B.shape(mag)[0]
    first_equal = B.compact(mag == t, k)
    ties = B.where(B.arange(k, like=mag) < room, first_equal, B.full((k,), n, "int64", like=mag))
    return B.sort(B.concat([B.compact(above, k), ties]))[:k]


@dataclass
class Selection:
    """A sparsifier's encoding context, read by decoding and by the state updates (DGC's
    masking): ``k`` slots, the chosen ``indices`` (0 in unused slots), which slots are
    ``valid``, and the values as ``sent`` (after the quantizer, if any)."""

    k: int
    indices: Any
    valid: Any
    sent: Any = None


class Sparsifier(Compressor):
    """Common part of top-k, random-k and DGC: select k indices, send (index, value)."""

    shared_indices = False

    def __init__(self, params=None, backend=None, rank=0, world_size=1, codec=None):
        from .backend import NUMPY
        super().__init__(params, backend or NUMPY, rank, world_size)
        self.codec = codec  # (name, params) of a quantizer for the kept values, or None
        self._codec = make_codec(codec[0], codec[1]) if codec else None
        if self._codec is not None:
            cparams = codec[1]
            self.noise = NoiseSource(self.B, int(cparams.get("seed", 0)), rank) \
                if self._codec.needs_noise else None
            self.name = f"{self.name}+{self._codec.name}"
        else:
            self.noise = None

    @property
    def summable(self):
        return self.shared_indices and (self._codec is None or self._codec.summable)

    # -- sizes -----------------------------------------------------------------------
    def k_for(self, meta, ctx=None) -> int:
        return count_for(float(self.params["ratio"]), meta.numel)

    def sends_indices(self, meta) -> bool:
        """Whether the payload carries the indices (not when every rank knows them)."""
        return not self.shared_indices

    def layout(self, meta, ctx=None) -> list:
        n, k = meta.numel, self.k_for(meta, ctx)
        segs = [Segment("indices", index_dtype(n), k)] if self.sends_indices(meta) else []
        if self._codec is None:
            segs.append(Segment("values", "float32", k))
        else:
            segs += self._codec.layout(k)
        return segs

    def payload_nbytes(self, meta, ctx=None) -> int:
        return sum(s.nbytes for s in self.layout(meta, ctx))

    # -- encode/decode --------------------------------------------------------------------
    def _select(self, v, meta, st, known=None):
        """(indices int64[k] in increasing order, with n marking empty slots, scale or None).
        ``known``: what the caller already computed of ``v`` (DGC's device passes: ``|v|``
        and the passes' object), or None."""
        raise NotImplementedError

    def _encode(self, v, meta, st, noise, flag, known=None) -> Encoded:
        B = self.B
        n, k = meta.numel, self.k_for(meta)
        idx, scale = self._select(v, meta, st, known)
        valid = idx < n
        safe = B.where(valid, idx, 0)
        ctx = Selection(k, safe, valid)
        values = B.where(valid, B.gather(v, safe), 0.0)
        if scale is not None:
            values = values * scale
        if self._codec is None:
            fields = {"values": values if flag is None else values * flag}
            ctx.sent = fields["values"]
        else:
            if self._codec.needs_noise and noise is None:
                noise = self.noise.draw(k, like=v)
            fields = self._codec.encode_values(B, values, flag, noise)
            ctx.sent = self._codec.decode_values(B, fields, k)
        if self.sends_indices(meta):
            fields["indices"] = B.cast(safe, index_dtype(n))
        if self.summable:
            payload = fields["values"]
        else:
            payload = join_segments(B, self.layout(meta, ctx), fields)
        return Encoded(payload, meta, self.payload_nbytes(meta, ctx), ctx=ctx)

    def _subtract_sent(self, v, enc) -> None:
        # Only k entries change: v[idx] -= sent (index 0 / value 0 in unused slots).
        self.B.index_add(v, enc.ctx.indices, -enc.ctx.sent)

    def _residual_device(self, clean, enc):
        # The same k-entry update, not a dense decode and subtraction (x - y == x + -y).
        return self.B.index_add(clean, enc.ctx.indices, -enc.ctx.sent)

    def _fields(self, payload, meta, ctx):
        if self.summable:
            return {"values": payload}
        return split_segments(self.B, self.layout(meta, ctx), payload)

    def _values(self, fields, meta, ctx):
        if self._codec is None:
            return fields["values"]
        return self._codec.decode_values(self.B, fields, self.k_for(meta, ctx))

    def _indices(self, fields, ctx):
        if "indices" not in fields:  # shared by every rank: this rank's own selection
            return ctx.indices
        return self.B.cast(fields["indices"], "int64")

    def scaled(self, result, received, enc, factor: float):
        """Only the coordinates the payloads name can be non-zero in a sparse aggregate:
        where they are few (at most 1/8 of the tensor) only they are scaled -- the same
        values as scaling every element (0 stays +0), without a pass over the tensor."""
        B, meta = self.B, enc.meta
        rows = [received] if self.summable else received
        flat = B.flat_view(result)
        if flat is None or 8 * len(rows) * self.k_for(meta, enc.ctx) > meta.numel:
            return super().scaled(result, received, enc, factor)
        idx = [self._indices(self._fields(p, meta, enc.ctx), enc.ctx) for p in rows]
        B.iscale_at(flat, idx[0] if len(idx) == 1 else B.concat(idx), factor)
        return result

    def _decode(self, payload, meta, ctx):
        fields = self._fields(payload, meta, ctx)
        return self.B.scatter_add(meta.numel, self._indices(fields, ctx),
                                  self._values(fields, meta, ctx))

    def aggregate(self, received, enc, out=None):
        B = self.B
        flat = self._flat_out(out, enc.meta)  # scatter straight into the caller's buffer
        total = B.izero(flat) if flat is not None else None
        for p in ([received] if self.summable else received):  # rank by rank: one order everywhere
            fields = self._fields(p, enc.meta, enc.ctx)
            idx, values = self._indices(fields, enc.ctx), self._values(fields, enc.meta, enc.ctx)
            total = B.scatter_add(enc.meta.numel, idx, values) if total is None else \
                B.index_add(total, idx, values)  # the first rank's into zeros, as one operation
        if total is None:  # nothing received
            total = B.zeros((enc.meta.numel,), "float32", like=enc.payload)
        return out if flat is not None else self._finish(total, enc.meta, out)

    def reduce_pair(self, a, b):
        if self._codec is not None:  # fp16/bf16 values: add in float32, round back
            B = self.B
            total = self._codec.decode_values(B, {"values": a}, 0) + \
                self._codec.decode_values(B, {"values": b}, 0)
            return self._codec.encode_values(B, total, 1.0, None)["values"]
        return a + b



class TopK(PayloadFastPath, Sparsifier):
    """Top-k sparsification (Aji & Heafield, EMNLP 2017; error feedback as in
    Stich et al. 2018): the k = ceil(ratio*n) largest magnitudes, sent with
    their indices; the rest stays in the residual."""

    name = "topk"

    def _select(self, v, meta, st, known=None):
        return topk_indices(self.B, self.B.abs(v), self.k_for(meta)), None


class RandomK(Sparsifier):
    """Random-k sparsification (Stich, Cordonnier & Jaggi, NeurIPS 2018).

    The k indices are the same on every rank for a given (seed, step, tensor
    name) -- one drawn uniformly from each of k equal strata, so every
    coordinate is kept with probability about k/n -- and are never sent: the k
    values are summed by allreduce.  ``unbiased=true`` scales each kept value
    by its stratum size (its inverse inclusion probability) and, by default,
    turns error feedback off.
    """

    name = "randomk"
    shared_indices = True

    def _encode_fused(self, g, meta, st, noise):
        """The step as the backend's fused encoder, where it has one (TensorFlow on CPU): the
        indices (and scales) from :meth:`_select`, the values at them and the new residual
        from ``fused(g, residual, indices, scale) -> (values, new residual, finite)``, with
        ``finite`` as :class:`~.base.PayloadFastPath` takes it.  None (the chain) with a
        quantizer of the values or where the backend has none."""
        B = self.B
        if self._codec is not None:
            return None
        fused = B.fused_encoder(self, 1, like=g)
        if fused is None:
            return None
        idx, scale = self._select(g, meta, st)  # the indices depend on no value
        values, residual, finite = fused(g, st.residual if self.ef else None, idx, scale)
        if host_nonfinite(finite):  # the reference step (the state is untouched)
            return self._encode_host_nonfinite(g, meta, st, noise)
        if self.ef:
            st.residual = kept_state(B, finite, residual, st.residual)
        ctx = Selection(self.k_for(meta), idx, idx < meta.numel, sent=values)
        return Encoded(values, meta, self.payload_nbytes(meta, ctx), ctx=ctx)

    def _select(self, v, meta, st, known=None):
        B = self.B
        k = self.k_for(meta)
        key0, key1 = stream_keys(B, int(self.params["seed"]), meta.name, st.step,
                                 PURPOSE_RANDOMK, like=v)
        idx, sizes = stratified_indices(B, meta.numel, k, key0, key1, like=v)
        scale = B.cast(sizes, "float32") if self.params["unbiased"] else None
        return idx, scale
