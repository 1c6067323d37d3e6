"""The host backends' fast paths: the numba kernels of :mod:`hvd_compress.kernels` behind
the core's one hook, ``B.fused_encoder(codec, cols)``.

The core (:mod:`hvd_compress.core`) holds only the reference chains and never
imports this module or numba.  Importing :mod:`hvd_compress` installs
:func:`host_encoder` in the core's provider slot
(:func:`hvd_compress.core.backend.set_host_fast_paths`); the numpy backend, and
the torch backend for CPU tensors, then answer ``fused_encoder`` from it.
numba is imported, and the kernels loaded from its cache, on the first
encoder asked for -- not when the package is imported.

Each encoder keeps the contract of ``NumpyBackend.fused_encoder`` with a
Python bool for ``finite``: the step starts as the core's host path does
(:func:`~hvd_compress.core.base.ef_sum_host`: finiteness, ``residual += g`` in
place, overflow counted as non-finite and undone); on NaN/Inf it returns at
once (no noise drawn) and the core runs its reference non-finite step.  The
scales come from the codec's own helpers (the reference arithmetic); the
kernels do the per-element passes -- sums, codes, bit packing and, for 1-bit
and threshold, the residual update -- with the same bits
(``tests/test_kernels.py``).  1-bit by columns (``cols`` > 1) is declined: the
chain runs.  ``HVD_COMPRESS_FUSED=0`` turns every fast path off.
"""

from __future__ import annotations

import os

import numpy as np

from .core.backend import set_host_fast_paths
from .core.base import ef_sum_host
from .core.bitpack import pack_codes, packed_nbytes

__all__ = ["requested", "host_encoder"]


def requested() -> bool:
    """Whether fast paths may run at all: ``HVD_COMPRESS_FUSED=0`` turns off the numba
    kernels and the TensorFlow ops of :mod:`hvd_compress.tensorflow.fused_ops`."""
    return os.environ.get("HVD_COMPRESS_FUSED", "1") != "0"


_KERNELS = None  # hvd_compress.kernels once loaded, False without numba


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from . import kernels  # imports numba (kernels compiled once, then cached on disk)
        _KERNELS = kernels if kernels.AVAILABLE else False
    return _KERNELS


def host_encoder(B, codec, cols: int):
    """A host backend's fused encoder for ``codec`` (see the module), or None: turned
    off, numba missing, a codec without kernels, or 1-bit by columns."""
    body = _BODIES.get(codec.name)
    if (body is None and codec.name != "signum") or (codec.name == "onebit" and cols != 1) \
            or not requested():
        return None
    k = _kernels()
    if not k:
        return None
    if codec.name == "signum":  # its state is the momentum, not an error-feedback residual
        return lambda g, momentum, noise, noise_source: _signum(k, B, codec, g, momentum)

    def encode(g, residual, noise, noise_source):
        v, finite = ef_sum_host(B, g, residual)
        if not finite:
            return None, residual, False
        n = B.shape(v)[0]
        if codec.needs_noise and noise is None:
            noise = noise_source.draw(n, like=g)
        fields = body(k, B, codec, v, noise, residual is not None)
        return fields, (v if residual is not None else None), True
    return encode


def _codes(n, bits):
    """A fresh numpy buffer for ``n`` packed ``bits``-bit codes."""
    return np.empty(packed_nbytes(n, bits), np.uint8)


def _subtract_decoded(B, codec, v, fields):
    """``v -= decoded`` (error feedback) for codecs whose kernel does not do it."""
    B.isub(v, codec.decode_values(B, fields, B.shape(v)[0]))


def _threshold(k, B, codec, v, noise, ef):
    tau = codec.tau
    out = _codes(B.shape(v)[0], 2)
    k.threshold_pack(B.host_view(v), np.float32(tau), out, ef)  # with ef: v -= sent
    return {"scale": B.asarray([tau], "float32", like=v), "codes": B.from_host(out)}


def _onebit(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    npos, spos, sneg = (np.asarray(t) for t in k.sign_sums(B.host_view(v)))  # one pass
    npos, spos, sneg = (B.from_host(t) for t in (npos.astype(np.int64), spos, sneg))
    pos, neg = codec.means(B, npos, spos, sneg, n, 1)
    out = _codes(n, 1)
    k.onebit_pack(B.host_view(v), np.float32(B.to_numpy(pos)[0]), np.float32(B.to_numpy(neg)[0]),
                  out, ef)  # with ef: v -= pos or neg
    return {"pos": pos, "neg": neg, "signs": B.from_host(out)}


def _terngrad(k, B, codec, v, noise, ef):
    n, c = B.shape(v)[0], codec.clip
    if c > 0:
        s1, s2 = (B.from_host(np.asarray(t)) for t in k.moments(B.host_view(v)))  # one pass
        cap = np.float32(c * B.to_numpy(codec.sigma(B, s1, s2, n)))
    else:
        cap = np.float32(np.inf)
    # the chain's max(min(|v|, cap)) is min(max|v|, cap): no pass but a min/max
    scale = np.minimum(np.float32(B.to_numpy(B.absmax(v))), cap)
    out = _codes(n, 2)
    k.terngrad_pack(B.host_view(v), B.host_view(noise), cap, np.float32(scale if scale > 0 else 1.0),
                    out)
    fields = {"scale": B.asarray([scale], "float32", like=v), "codes": B.from_host(out)}
    if ef:
        _subtract_decoded(B, codec, v, fields)
    return fields


def _qsgd(k, B, codec, v, noise, ef):
    n, packed = B.shape(v)[0], codec.bits == 4
    norms, inv = codec.scales(B, v)
    out = _codes(n, 4) if packed else np.empty(n, np.uint8)  # 4-bit codes: packed by the kernel
    k.qsgd_codes(B.host_view(v), B.host_view(B.cast(inv, "float32")), B.host_view(noise),
                 codec.s, codec.d, packed, out)
    codes = B.from_host(out)
    fields = {"norms": norms, "codes": codes if packed else pack_codes(B, codes, codec.bits)}
    if ef:
        _subtract_decoded(B, codec, v, fields)
    return fields


def _sign(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    vh = B.host_view(v)
    # the chain's float64 L1 sum divided by n, rounded to float32 (1 for signSGD)
    scale = np.float32(k.abs_sum(vh) / n) if codec.scaled else \
        np.float32(B.to_numpy(B.absmax(v)) > 0)  # 0 for an all-zero tensor, as the chain
    out = _codes(n, 1)
    k.onebit_pack(vh, scale, -scale, out, ef)  # with ef: v -= +-scale
    return {"scale": B.asarray([scale], "float32", like=v), "signs": B.from_host(out)}


def _signum(k, B, codec, g, momentum):
    """Signum's step in one pass: the new momentum (a fresh buffer: the old one stays
    if the step is not finite), its sign bits, and whether it is finite and nonzero."""
    n = B.shape(g)[0]
    fresh, signs = np.empty(n, np.float32), _codes(n, 1)
    finite, nonzero = k.signum_step(B.host_view(momentum), B.host_view(g), np.float32(codec.beta),
                                    np.float32(1.0 - codec.beta), fresh, signs)
    if not finite:
        return None, momentum, False
    fields = {"scale": B.asarray([1.0 if nonzero else 0.0], "float32", like=g),
              "signs": B.from_host(signs)}
    return fields, B.from_host(fresh), True


def _natural(k, B, codec, v, noise, ef):
    n = B.shape(v)[0]
    exps, signs = np.empty(n, np.uint8), _codes(n, 1)
    k.natural_codes(B.host_view(v), B.host_view(noise), codec.powers, exps, signs, ef)
    return {"exps": B.from_host(exps), "signs": B.from_host(signs)}


def _uniform(k, B, codec, v, noise, ef):
    n, bits, d = B.shape(v)[0], codec.bits, codec.d
    vh = B.host_view(v)
    lo, hi = (B.from_host(t) for t in k.bucket_minmax(vh, d))
    scale, inv = codec.scales(B, lo, hi)
    pack = bits if 8 % bits == 0 else 8  # other widths: one code a byte, packed after
    out = _codes(n, pack)
    u = B.host_view(noise) if codec.needs_noise else np.empty(0, np.float32)
    k.uniform_codes(vh, B.host_view(inv), B.host_view(lo * inv), u, np.float32(codec.levels), d,
                    codec.needs_noise, pack, out, B.host_view(lo), B.host_view(scale), ef)
    codes = B.from_host(out)
    return {"mins": lo, "scales": scale, "codes": codes if pack == bits else pack_codes(B, codes, bits)}


def start_table(edges, scale=1.0):
    """For each 16-bit prefix of a float32 ``x`` (its sign, exponent and 7 mantissa bits):
    how many of the sorted ``edges`` are <= the smallest ``x * scale`` with that prefix,
    a count the kernels go on from (one or two comparisons instead of a binary search;
    exact, as the smallest value of a prefix bounds every value of it)."""
    prefix = np.arange(65536, dtype=np.uint32) << 16
    first = prefix.view(np.float32)  # the prefix's value with the other bits 0
    last = (prefix | 0xFFFF).view(np.float32)  # ... and 1: the most negative of a negative one
    with np.errstate(invalid="ignore", over="ignore"):
        low = np.where((prefix >> 31) == 1, last, first) * np.float32(scale)
        table = np.searchsorted(edges, low, side="right")
    table[np.isnan(low)] = 0
    return table.astype(np.int32)


def _eightbit(k, B, codec, v, noise, ef):
    s = B.absmax(v)
    inv = np.float32(B.to_numpy(codec.inverse(B, s)))
    out = np.empty(B.shape(v)[0], np.uint8)
    k.eightbit_codes(B.host_view(v), inv, codec.edges, start_table(codec.edges, inv),
                     codec.levels, np.float32(B.to_numpy(s)), out, ef)
    return {"scale": B.reshape(B.cast(s, "float32"), (1,)), "codes": B.from_host(out)}


_CHUNKS = 64  # SketchML's sums: fixed stretches, so the bits do not depend on the threads


def _sketchml(k, B, codec, v, noise, ef):
    vh = B.host_view(v)
    codes = np.empty(B.shape(v)[0], codec.code_dtype)
    edges = np.ascontiguousarray(B.host_view(codec.edges(B, v)))  # the chain's: a sorted sample
    sums, counts = k.bucket_codes(vh, edges, start_table(edges), codes, codec.q, _CHUNKS)
    means = codec.means(B, B.from_host(sums), B.from_host(counts))
    if ef:
        k.lookup_subtract(vh, codes, B.host_view(means))
    return {"means": means, "codes": B.from_host(codes)}


_BODIES = {"threshold": _threshold, "onebit": _onebit, "terngrad": _terngrad, "qsgd": _qsgd,
           "signsgd": _sign, "efsignsgd": _sign, "natural": _natural, "uniform": _uniform,
           "eightbit": _eightbit, "sketchml": _sketchml}


def host_decoder(B, codec, cols: int):
    """A host backend's fused decoder for ``codec`` -- ``(fields, n) -> float32[n]``, the
    chain's bits -- or None: turned off, numba missing, or a codec without one."""
    body = _DECODERS.get(codec.name)
    if body is None or not requested() or (codec.name == "uniform" and 8 % codec.bits):
        return None
    k = _kernels()
    if not k:
        return None

    def decode(fields, n):
        out = np.empty(n, np.float32)
        body(k, B, codec, {key: B.host_view(a) for key, a in fields.items()}, out)
        return B.from_host(out)
    return decode


def _natural_decode(k, B, codec, f, out):
    k.natural_decode(f["exps"], f["signs"], codec.powers.view(np.int32), out.view(np.int32))


def _sign_decode(k, B, codec, f, out):
    k.sign_decode(f["signs"], f["scale"].view(np.int32)[0], out.view(np.int32))


def _uniform_decode(k, B, codec, f, out):
    k.uniform_decode(f["codes"], codec.bits, codec.d, f["mins"], f["scales"], out)


def _eightbit_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], codec.levels, np.float32(f["scale"][0]), out)


def _sketchml_decode(k, B, codec, f, out):
    k.lookup_scaled(f["codes"], f["means"], np.float32(1.0), out)


_DECODERS = {"signsgd": _sign_decode, "efsignsgd": _sign_decode, "signum": _sign_decode,
             "natural": _natural_decode, "uniform": _uniform_decode, "eightbit": _eightbit_decode,
             "sketchml": _sketchml_decode}

set_host_fast_paths(host_encoder, host_decoder)
