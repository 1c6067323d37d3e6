"""Host fast paths of the sign codecs: threshold, 1-bit SGD (whole tensor and by
columns), signSGD / EF-signSGD and Signum (kernels: :mod:`.kernels_signs`).

The scales come from the codec's own helpers (the reference arithmetic); the kernels
do the per-element passes -- sums, codes, bit packing and the residual update -- with
the chain's bits.  1-bit by columns (``cols`` > 1) sums each column down the rows, as
numpy does.
"""

from __future__ import annotations

import functools

import numpy as np

from ..core.onebit import OneBitCodec
from ..core.signs import EFSignCodec, SignCodec, SignumCodec
from ..core.threshold import ThresholdCodec
from .host import code_buffer, ef_encoder, register


def _threshold(k, B, codec, v, noise, ef):
    tau = codec.tau
    out = code_buffer(B.shape(v)[0], 2)
    k.threshold_pack(B.host_view(v), np.float32(tau), out, ef)  # with ef: v -= sent
    return {"scale": B.asarray([tau], "float32", like=v), "codes": B.from_host(out)}


def _onebit(k, B, codec, v, noise, ef, cols=1):
    n = B.shape(v)[0]
    vh = B.host_view(v)
    if cols == 1:
        return _onebit_fields(B, codec, n, k.sign_sums(vh),  # one pass
                              lambda pos, neg, out: k.onebit_pack(vh, pos, neg, out, ef))
    # by columns: one pass down the rows, the reference's sums and order
    npos, total, spos = np.empty(cols, np.int64), np.empty(cols), np.empty(cols)
    k.column_sign_sums(vh.reshape(-1, cols), npos, total, spos)
    sneg = total - spos  # as the reference derives it
    npos, spos, sneg = (B.from_host(t) for t in (npos, spos, sneg))
    pos, neg = codec.means(B, npos, spos, sneg, n // cols, cols)
    out = code_buffer(n, 1)
    k.onebit_pack_columns(vh, B.host_view(neg), B.host_view(pos), out, ef)
    return {"pos": pos, "neg": neg, "signs": B.from_host(out)}


def _onebit_fields(B, codec, n, sums, pack):
    """One column's fields from its sign sums ``(npos, spos, sneg)``: the means by the
    codec's arithmetic, then ``pack(pos, neg, out)`` (float32 means, the bits' buffer)."""
    npos, spos, sneg = np.asarray(sums[0]).astype(np.int64), np.asarray(sums[1]), \
        np.asarray(sums[2])
    npos, spos, sneg = (B.from_host(t) for t in (npos, spos, sneg))
    pos, neg = codec.means(B, npos, spos, sneg, n, 1)
    out = code_buffer(n, 1)
    pack(np.float32(B.to_numpy(pos)[0]), np.float32(B.to_numpy(neg)[0]), out)
    return {"pos": pos, "neg": neg, "signs": B.from_host(out)}


def _sign(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    vh = B.host_view(v)
    # the chain's float64 L1 sum divided by n, rounded to float32 (1 for signSGD)
    scale = np.float32(k.abs_sum(vh) / n) if codec.scaled else \
        np.float32(B.to_numpy(B.absmax(v)) > 0)  # 0 for an all-zero tensor, as the chain
    out = code_buffer(n, 1)
    k.onebit_pack(vh, scale, -scale, out, ef)  # with ef: v -= +-scale
    return {"scale": B.asarray([scale], "float32", like=v), "signs": B.from_host(out)}


def _signum(k, B, codec, g, momentum):
    """Signum's step in one pass: the new momentum (a fresh buffer: the old one stays
    if the step is not finite), its sign bits, and whether it is finite and nonzero."""
    n = B.shape(g)[0]
    fresh, signs = np.empty(n, np.float32), code_buffer(n, 1)
    finite, nonzero = k.signum_step(B.host_view(momentum), B.host_view(g), np.float32(codec.beta),
                                    np.float32(1.0 - codec.beta), fresh, signs)
    if not finite:
        return None, momentum, False
    fields = {"scale": B.asarray([1.0 if nonzero else 0.0], "float32", like=g),
              "signs": B.from_host(signs)}
    return fields, B.from_host(fresh), True


def two_bit_decode(k, B, codec, f, out):
    """TernGrad's and threshold's codes: the chain's table ``[0, 1, -1, 0] * scale``."""
    k.lookup_2bit(f["codes"], np.asarray([0.0, 1.0, -1.0, 0.0], np.float32) * f["scale"][0], out)


def _sign_decode(k, B, codec, f, out):
    k.bit_decode(f["signs"], np.concatenate([-f["scale"], f["scale"]]), out)


def _onebit_decode(k, B, codec, f, out):
    if f["pos"].shape[0] == 1:  # one column: a two-entry table
        k.bit_decode(f["signs"], np.concatenate([f["neg"], f["pos"]]), out)
    else:
        k.bit_decode_columns(f["signs"], f["neg"], f["pos"], out)


def _onebit_encoder(k, B, codec, cols):
    """1-bit SGD's step.  One column with error feedback: the sum ``y = residual + g`` read
    in the two passes (sums, then bits and the new residual written once) -- two passes
    over the tensor where the core's host start and the column's kernels take five (the
    same bits); where a ``y`` is not finite, nothing touched, that start's way."""
    chain = ef_encoder(functools.partial(_onebit, cols=cols))(k, B, codec, cols)
    if cols != 1:
        return chain

    def encode(g, residual, noise, noise_source):
        if residual is None:
            return chain(g, residual, noise, noise_source)
        gh, rh = B.host_view(g), B.host_view(residual)
        *sums, bad = k.ef_sign_sums(rh, gh)
        if bad:
            return chain(g, residual, noise, noise_source)
        fields = _onebit_fields(B, codec, gh.shape[0], sums,
                                lambda pos, neg, out: k.ef_onebit_pack(rh, gh, pos, neg, out))
        return fields, residual, True
    return encode


def _signum_encoder(k, B, codec, cols):
    """Signum's state is the momentum, not an error-feedback residual."""
    return lambda g, momentum, noise, noise_source: _signum(k, B, codec, g, momentum)


register(ThresholdCodec, encoder=ef_encoder(_threshold), decoder=two_bit_decode)
register(OneBitCodec, encoder=_onebit_encoder, decoder=_onebit_decode)
for _cls in (SignCodec, EFSignCodec):
    register(_cls, encoder=ef_encoder(_sign), decoder=_sign_decode)
register(SignumCodec, encoder=_signum_encoder, decoder=_sign_decode)
