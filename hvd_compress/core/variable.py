"""Compressors whose payload size depends on the values: threshold-v, adaptive
quantization and INCEPTIONN.

Their payloads differ from rank to rank and from step to step.  The engine
therefore gathers them as rows of different lengths: first each rank's row
length (one 8-byte allgather), then the rows (Horovod's allgather takes rows of
different lengths), each row headed by its tensors' payload lengths
(:meth:`~hvd_compress.core.exchange.Exchange._start`).  ``Encoded.nbytes`` is the
payload's exact size; the engine's account adds the header and the length.

Payloads (``n`` elements; indices int32, int64 when ``n >= 2**31``; increasing)::

    thresholdv   flag float32[1], values float32[k], indices[k]
    adaq         flag float32[1], means float32[2] (mu+, mu-), count int32[1] (k+),
                 indices[k+] (the positive ones), indices[k-] (the negative ones)

``flag`` is 1, or NaN for a non-finite step (the aggregate is then NaN
throughout, as for every quantized and sparsified format).
"""

from __future__ import annotations

import math

from .base import Compressor, Encoded, PayloadFastPath
from .bitpack import pack_codes, unpack_codes
from .sparsifiers import Selection, index_dtype, topk_indices

_ISIZE = {"int32": 4, "int64": 8}


class VariableSparsifier(PayloadFastPath, Compressor):
    """Sends some indices and what their values become; the rest stays in the residual."""

    variable_size = True
    fixed_bytes = per_value = 0  # bytes of every payload; bytes beside each index

    def _pick(self, v, meta):
        """``(indices int64 increasing, sent float32 values, header fields)``."""
        raise NotImplementedError

    def _header(self, B, flag, like, fields) -> list:
        one = B.scalar(1.0, like=like) if flag is None else flag
        return [B.bitcast(B.reshape(B.cast(one, "float32"), (1,)), "uint8")] + fields

    def _encode(self, v, meta, st, noise, flag) -> Encoded:
        B = self.B
        idx, sent, parts = self._pick(v, meta)
        itype = index_dtype(meta.numel)
        body = parts + [B.bitcast(B.cast(i, itype), "uint8") for i in idx]
        payload = B.concat(self._header(B, flag, v, body))
        k = sum(B.shape(i)[0] for i in idx)
        indices = idx[0] if len(idx) == 1 else B.concat(idx)
        ctx = Selection(k, indices, None, sent=sent)
        return Encoded(payload, meta, B.shape(payload)[0], ctx=ctx)

    def payload_nbytes(self, meta, ctx=None) -> int:
        """The most this tensor can take (every element sent); a step's own size is its
        ``Encoded.nbytes``."""
        return self.fixed_bytes + (_ISIZE[index_dtype(meta.numel)] + self.per_value) * meta.numel

    def _subtract_sent(self, v, enc) -> None:
        self.B.index_add(v, enc.ctx.indices, -enc.ctx.sent)

    def _residual_device(self, clean, enc):
        return self.B.index_add(clean, enc.ctx.indices, -enc.ctx.sent)

    def _decode(self, payload, meta, ctx=None):
        B = self.B
        total = B.zeros((meta.numel,), "float32", like=payload)
        total, poison = self._add(total, payload, meta, B.scalar(0.0, like=total))
        return _poisoned(B, total, poison)

    def aggregate(self, received, enc, out=None):
        B = self.B
        flat = self._flat_out(out, enc.meta)
        total = B.izero(flat) if flat is not None else \
            B.zeros((enc.meta.numel,), "float32", like=enc.payload)
        poison = B.scalar(0.0, like=total)
        for p in received:  # rank by rank: one order everywhere
            total, poison = self._add(total, p, enc.meta, poison)
        total = _poisoned(B, total, poison)
        return out if flat is not None and total is flat else self._finish(total, enc.meta, out)

    def _add(self, total, payload, meta, poison):
        """``total`` plus this payload's values (in place), and ``poison`` plus its flag
        times 0 (NaN for a non-finite step)."""
        raise NotImplementedError


def _poisoned(B, total, poison):
    """``total``, made NaN throughout when ``poison`` (a 0-d sum of flags times 0) is NaN;
    in host memory no pass when it is not."""
    return B.cond(B.isfinite(poison), lambda: total, lambda: total + poison)


def _indices(B, payload, start: int, k: int, itype: str):
    size = _ISIZE[itype]
    return B.cast(B.bitcast(payload[start:start + size * k], itype), "int64"), start + size * k


class ThresholdV(VariableSparsifier):
    """Threshold-v (the variable-size threshold sparsifier of Strom 2015 and GRACE's
    ``threshold``): every value with ``|v| > tau`` is sent with its index, the rest
    stays in the residual (error feedback, on by default).  How many are sent depends
    on the values: none, or all of them."""

    name = "thresholdv"

    fixed_bytes, per_value = 4, 4  # the flag; a value beside each index

    def _pick(self, v, meta):
        B = self.B
        idx = B.nonzero(B.abs(v) > float(self.params["tau"]))
        vals = B.gather(v, idx)
        return [idx], vals, [B.bitcast(vals, "uint8")]

    def _add(self, total, payload, meta, poison):
        B = self.B
        itype = index_dtype(meta.numel)
        k = (B.shape(payload)[0] - 4) // (4 + _ISIZE[itype])
        flag = B.bitcast(payload[:4], "float32")
        vals = B.bitcast(payload[4:4 + 4 * k], "float32")
        idx, _ = _indices(B, payload, 4 + 4 * k, k, itype)
        return B.index_add(total, idx, vals), poison + flag[0] * 0.0


class SignCounts:
    """What adaptive quantization asks a device backend's fast-path hook for
    (``B.fused_encoder(SIGN_COUNTS, 1, like=v)``): a callable ``v -> (positives,
    negatives)``, Python ints (one read on the host: the payload's size needs them), or
    None; a None hook or answer: a count per sign."""

    name = "adaq_sign_counts"


SIGN_COUNTS = SignCounts()


class AdaptiveQuantization(VariableSparsifier):
    """Adaptive quantization (Dryden, Moon, Jacobs & Van Essen, MLHPC 2016,
    "Communication Quantization for Data-parallel Training of Deep Neural Networks"):
    of the positive values, the ``ratio`` largest (``k+ = ceil(ratio * n+)``) are sent
    as their indices and all become their mean ``mu+``; the same for the negative
    values with ``mu-``; the rest, and the quantization error, stay in the residual.

    The thresholds are exact here (the k+ largest positive values, ties to the lower
    index), where GRACE estimates them from a sample and tunes them; ``ratio``
    defaults to 1% like our other sparsifiers (GRACE's ``adaq`` takes 0.3)."""

    name = "adaq"
    max_numel = 2 ** 31 - 1  # k+ travels as int32

    fixed_bytes, per_value = 16, 0  # flag, two means, k+; indices only

    def count(self, n_sign: int) -> int:
        """How many of a sign's ``n_sign`` values are sent (0 when there are none)."""
        ratio = float(self.params["ratio"])
        return min(n_sign, max(1, math.ceil(ratio * n_sign - 1e-9))) if n_sign else 0

    def mean(self, v, chosen, k: int):
        """The float32 mean of ``v`` at the ``k`` indices ``chosen`` (summed in float64),
        0 for none: what those values become (a fast path derives it the same way)."""
        B = self.B
        if not k:
            return B.scalar(0.0, like=v)
        return B.cast(B.div(B.sum64(B.gather(v, chosen)), float(k)), "float32")

    def _pick(self, v, meta):
        B = self.B
        idx, sent, means, counts = [], [], [], []
        both = None if B.is_host(v) else B.fused_encoder(SIGN_COUNTS, 1, like=v)
        both = None if both is None else both(v)
        for i, sign in enumerate((1.0, -1.0)):
            mag = B.maximum(v * sign, 0.0)  # this sign's magnitudes, 0 elsewhere
            k = self.count(int(B.count_nonzero(mag > 0)) if both is None else both[i])
            chosen = topk_indices(B, mag, k) if k else B.zeros((0,), "int64", like=v)
            mean = self.mean(v, chosen, k)
            idx.append(chosen)
            sent.append(B.full((k,), 0.0, like=v) + mean)
            means.append(B.reshape(B.cast(mean, "float32"), (1,)))
            counts.append(k)
        head = [B.bitcast(B.concat(means), "uint8"),
                B.bitcast(B.asarray([counts[0]], "int32", like=v), "uint8")]
        return idx, B.concat(sent), head

    def _add(self, total, payload, meta, poison):
        B = self.B
        itype = index_dtype(meta.numel)
        flag = B.bitcast(payload[:4], "float32")
        means = B.bitcast(payload[4:12], "float32")
        kpos = int(B.to_numpy(B.bitcast(payload[12:16], "int32"))[0])
        kneg = (B.shape(payload)[0] - 16) // _ISIZE[itype] - kpos
        pos, at = _indices(B, payload, 16, kpos, itype)
        neg, _ = _indices(B, payload, at, kneg, itype)
        total = B.index_add(total, pos, B.full((kpos,), 0.0, like=total) + means[0])
        total = B.index_add(total, neg, B.full((kneg,), 0.0, like=total) + means[1])
        return total, poison + flag[0] * 0.0


class Inceptionn(PayloadFastPath, Compressor):
    """INCEPTIONN's error-bounded lossy compression of gradients (Li et al., MICRO 2018,
    "A Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed Training
    of Deep Neural Networks"): every value is sent with the fewest bits that keep it
    within ``bound`` of the original -- 0 (it decodes to 0), 8, 16 or 32 bits -- so
    the small values that dominate a gradient travel in 0 or 8 bits.

    Each value becomes ``q = round(v / s)`` on the grid ``s = 2 * bound * (1 - 2^-7)``
    (the margin keeps float32's own rounding of ``q * s`` inside the bound): ``q = 0``
    takes 0 bits, ``|q| <= 127`` 8 bits, ``|q| <= 32767`` 16 bits, larger values are
    sent as float32 (exact).  So ``|v - decoded| <= bound`` for every element, always
    (tested), where ``v`` is the float32 value encoded: like every compressor here,
    INCEPTIONN works in float32, so a float64 gradient is rounded to
    float32 first and its own rounding error (relative 2^-24) adds to the bound.
    The paper groups values by their float exponent and truncates the
    mantissa (GRACE's ``inceptionn`` likewise); a fixed grid gives the same widths by
    magnitude with a bound that is exact by construction.  ``bound`` defaults to 2^-10,
    the cut below which GRACE's default drops values.

    Payload: ``flag float32[1], n32 int32[1], n16 int32[1], float32[n32],
    int16[n16] (q), uint8[n8] (q + 128), width codes 2-bit x n`` -- the
    values of each width in increasing index order.
    """

    name = "inceptionn"
    fresh_decode = True  # the kernel's and the chain's decodes make their own arrays
    variable_size = True
    max_numel = 2 ** 31 - 1  # the counts of each width travel as int32

    @property
    def step(self) -> float:
        return 2.0 * float(self.params["bound"]) * (1.0 - 2.0 ** -7)

    def payload_nbytes(self, meta, ctx=None) -> int:
        """The most a tensor can take (every value in 32 bits)."""
        return 12 + 4 * meta.numel + -(-meta.numel // 4)

    def _encode(self, v, meta, st, noise, flag) -> Encoded:
        B = self.B
        t = B.floor(B.cast(v, "float64") * (1.0 / self.step) + 0.5)  # q, float64
        a = B.abs(t)
        width = B.cast(a > 0, "int32") + B.cast(a > 127, "int32") + B.cast(a > 32767, "int32")
        wide, mid, low = (B.nonzero(width == w) for w in (3, 2, 1))
        head = B.asarray([B.shape(wide)[0], B.shape(mid)[0]], "int32", like=v)
        one = B.scalar(1.0, like=v) if flag is None else flag
        parts = [B.bitcast(B.reshape(B.cast(one, "float32"), (1,)), "uint8"),
                 B.bitcast(head, "uint8"),
                 B.bitcast(B.gather(v, wide), "uint8"),
                 B.bitcast(B.cast(B.gather(t, mid), "int16"), "uint8"),
                 B.cast(B.gather(t, low) + 128.0, "uint8"),
                 pack_codes(B, width, 2)]
        payload = B.concat(parts)
        return Encoded(payload, meta, B.shape(payload)[0])

    def _decode(self, payload, meta, ctx=None):
        B = self.B
        fused = B.fused_decoder(self, 1, like=payload)
        if fused is not None:  # the backend's fast path (None for this payload: the chain)
            dense = fused({"payload": payload}, meta.numel)
            if dense is not None:
                return dense
        n, s = meta.numel, self.step
        flag = B.bitcast(payload[:4], "float32")
        n32, n16 = (int(c) for c in B.to_numpy(B.bitcast(payload[4:12], "int32")))
        at = 12
        wide = B.bitcast(payload[at:at + 4 * n32], "float32")
        at += 4 * n32
        mid = B.cast(B.bitcast(payload[at:at + 2 * n16], "int16"), "float64")
        at += 2 * n16
        nbytes = B.shape(payload)[0]
        low = B.cast(payload[at:nbytes - -(-n // 4)], "float64")
        width = unpack_codes(B, payload[nbytes - -(-n // 4):], 2, n)
        dense = B.zeros((n,), "float32", like=payload)
        for w, vals in ((3, wide), (2, B.cast(mid * s, "float32")),
                        (1, B.cast((low - 128.0) * s, "float32"))):
            dense = B.index_add(dense, B.nonzero(width == w), vals)
        return _poisoned(B, dense, flag[0] * 0.0)
