"""Triton kernels of the device fast paths: the quantizers' statistics, codes with their
packing and error feedback, and the packed codes' decoding, each one pass over memory
where the torch chain makes several (importing this imports triton).

Every kernel computes what the reference chain computes, operation by operation, with
its roundings: products and sums rounded one by one (the launches pass
``enable_fp_fusion=False``: no fused multiply-adds), divisions correctly rounded
(``div_rn``; Triton's ``/`` is approximate on NVIDIA GPUs), NaN/Inf entries read as 0
(the chain's ``zero_nonfinite``) and counted.  Sums of squares accumulate in float64, as
the reference's do.  Indices are int32 (a 32-bit division per value, not a 64-bit one)
unless ``WIDE`` (tensors of 2**31 values and more, with a bucket's margin).
:func:`launch` runs one on its tensors' GPU.  The wrappers are in
:mod:`.triton_quantizers` (INCEPTIONN's kernels: :mod:`.triton_inceptionn`).
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))  # a jit function reads constexpr globals only


@triton.jit
def _pid(WIDE: tl.constexpr):
    """The program's index, int64 where indices may pass 2**31."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    return pid


@triton.jit
def _clean(x):
    """``x`` with NaN/Inf read as 0, and whether each entry was finite."""
    fin = tl.abs(x) < INF
    return tl.where(fin, x, 0.0), fin


@triton.jit
def bucket_stats(x_ptr, r_ptr, n, d, nb, sum_ptr, sumsq_ptr, lo_ptr, hi_ptr, top_ptr, bad_ptr,
                 HAS_R: tl.constexpr, SUMS: tl.constexpr, MINMAX: tl.constexpr,
                 TOP: tl.constexpr, ABS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Per bucket of ``d`` values of ``v = x (+ r)`` with NaN/Inf read as 0 (``ROWS``
    buckets a program, ``BLOCK`` values of each at a time): the float64 sum (of |v| with
    ``ABS``) and sum of squares (``SUMS``), the min and max (``MINMAX``), max |v| (``TOP``), and how many
    entries were not finite (always)."""
    b = _pid(WIDE) * ROWS + tl.arange(0, ROWS)
    start = (b * d)[:, None]
    acc1 = tl.zeros([ROWS, BLOCK], tl.float64)
    acc2 = tl.zeros([ROWS, BLOCK], tl.float64)
    lo = tl.full([ROWS, BLOCK], INF, tl.float32)
    hi = tl.full([ROWS, BLOCK], -INF, tl.float32)
    top = tl.zeros([ROWS, BLOCK], tl.float32)
    bad = tl.zeros([ROWS, BLOCK], tl.int32)
    for off in range(0, d, BLOCK):
        j = (off + tl.arange(0, BLOCK))[None, :]
        idx = start + j
        m = (j < d) & (idx < n)
        x = tl.load(x_ptr + idx, mask=m, other=0.0)
        if HAS_R:
            x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
        fin = tl.abs(x) < INF
        x = tl.where(fin, x, 0.0)
        bad += (m & (fin == 0)).to(tl.int32)
        if SUMS:
            x64 = x.to(tl.float64)
            if ABS:
                acc1 += tl.abs(x64)
            else:
                acc1 += x64
            acc2 += x64 * x64
        if MINMAX:
            lo = tl.minimum(lo, tl.where(m, x, INF))
            hi = tl.maximum(hi, tl.where(m, x, -INF))
        if TOP:
            top = tl.maximum(top, tl.abs(x))
    rows = b < nb
    if SUMS:
        tl.store(sum_ptr + b, tl.sum(acc1, 1), mask=rows)
        tl.store(sumsq_ptr + b, tl.sum(acc2, 1), mask=rows)
    if MINMAX:
        tl.store(lo_ptr + b, tl.min(lo, 1), mask=rows)
        tl.store(hi_ptr + b, tl.max(hi, 1), mask=rows)
    if TOP:
        tl.store(top_ptr + b, tl.max(top, 1), mask=rows)
    tl.store(bad_ptr + b, tl.sum(bad, 1), mask=rows)


@triton.jit
def _pack(code, BITS: tl.constexpr, PER: tl.constexpr):
    """Rows of ``PER`` codes of ``BITS`` bits as one byte each, the first in the low bits."""
    shifts = (tl.arange(0, PER) * BITS)[None, :]
    return tl.sum(code << shifts, 1).to(tl.uint8)


@triton.jit
def _layout(BYTES: tl.constexpr, PER: tl.constexpr, WIDE: tl.constexpr):
    """The program's bytes and each byte's ``PER`` value indices (rows x PER)."""
    byte = _pid(WIDE) * BYTES + tl.arange(0, BYTES)
    idx = byte[:, None] * PER + tl.arange(0, PER)[None, :]
    return byte, idx


@triton.jit
def qsgd_codes(x_ptr, r_ptr, u_ptr, inv_ptr, f_ptr, n, nbytes, d, s, sf, codes_ptr, res_ptr,
               HAS_R: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
               BYTES: tl.constexpr, WIDE: tl.constexpr):
    """QSGD codes ``s + sign * min(floor(|v| * inv[bucket] + u), s)`` packed ``PER`` a byte,
    and with ``HAS_R`` the new residual ``v - (code - s) * f[bucket]`` (``sf``: ``s`` as a
    float)."""
    byte, idx = _layout(BYTES, PER, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    u = tl.load(u_ptr + idx, mask=m, other=0.0)
    bucket = idx // d
    inv = tl.load(inv_ptr + bucket, mask=m, other=0.0)
    t = tl.abs(x) * inv
    t = t + u
    lv = tl.minimum(tl.floor(t), sf).to(tl.int32)
    code = s + lv - 2 * lv * (x < 0).to(tl.int32)
    code = tl.where(m, code, 0)
    tl.store(codes_ptr + byte, _pack(code, BITS, PER), mask=byte < nbytes)
    if HAS_R:
        f = tl.load(f_ptr + bucket, mask=m, other=0.0)
        tl.store(res_ptr + idx, x - (code - s).to(tl.float32) * f, mask=m)


@triton.jit
def terngrad_codes(x_ptr, r_ptr, u_ptr, cap_ptr, safe_ptr, scale_ptr, n, nbytes, codes_ptr,
                   res_ptr, HAS_R: tl.constexpr, CLIP: tl.constexpr, BYTES: tl.constexpr,
                   WIDE: tl.constexpr):
    """TernGrad codes (1: +scale, 2: -scale, 0) kept with probability ``min(|v|, cap) /
    safe``, packed 4 a byte, and with ``HAS_R`` the new residual ``v - decoded``."""
    byte, idx = _layout(BYTES, 4, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    u = tl.load(u_ptr + idx, mask=m, other=0.0)
    mag = tl.abs(x)
    if CLIP:
        mag = tl.minimum(mag, tl.load(cap_ptr))
    prob = tl.div_rn(mag, tl.load(safe_ptr) + tl.zeros_like(mag))
    keep = ((u < prob) & m).to(tl.int32)
    code = keep + keep * (x < 0).to(tl.int32)
    tl.store(codes_ptr + byte, _pack(code, 2, 4), mask=byte < nbytes)
    if HAS_R:
        scale = tl.load(scale_ptr)
        dec = tl.where(code == 1, scale, tl.where(code == 2, -scale, 0.0 * scale))
        tl.store(res_ptr + idx, x - dec, mask=m)


@triton.jit
def uniform_codes(x_ptr, r_ptr, u_ptr, inv_ptr, loinv_ptr, scale_ptr, lo_ptr, n, nbytes, d,
                  levels, codes_ptr, res_ptr, HAS_R: tl.constexpr, STOCHASTIC: tl.constexpr,
                  BITS: tl.constexpr, PER: tl.constexpr, BYTES: tl.constexpr,
                  WIDE: tl.constexpr):
    """Uniform max-min codes ``min(floor(clip(v * inv - lo * inv, 0, L) + u), L)`` (``u``
    the noise, or 0.5 to round to nearest) packed ``PER`` a byte, and with ``HAS_R`` the
    new residual ``v - (code * scale + lo)``."""
    byte, idx = _layout(BYTES, PER, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    bucket = idx // d
    t = x * tl.load(inv_ptr + bucket, mask=m, other=0.0)
    t = t - tl.load(loinv_ptr + bucket, mask=m, other=0.0)
    t = tl.minimum(tl.maximum(t, 0.0), levels)
    if STOCHASTIC:
        t = t + tl.load(u_ptr + idx, mask=m, other=0.0)
    else:
        t = t + 0.5
    code = tl.minimum(tl.floor(t), levels).to(tl.int32)
    code = tl.where(m, code, 0)
    tl.store(codes_ptr + byte, _pack(code, BITS, PER), mask=byte < nbytes)
    if HAS_R:
        step = code.to(tl.float32) * tl.load(scale_ptr + bucket, mask=m, other=0.0)
        tl.store(res_ptr + idx, x - (step + tl.load(lo_ptr + bucket, mask=m, other=0.0)), mask=m)


@triton.jit
def unpack_values(data_ptr, values_ptr, f_ptr, lo_ptr, n, nbytes, d, out_ptr, HAS_F: tl.constexpr,
                  HAS_LO: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                  BYTES: tl.constexpr, WIDE: tl.constexpr):
    """``values[code]`` for ``n`` packed ``BITS``-bit codes (``PER`` a byte), times
    ``f[bucket]`` (``HAS_F``), plus ``lo[bucket]`` (``HAS_LO``), buckets of ``d``."""
    byte, idx = _layout(BYTES, PER, WIDE)
    m = idx < n
    data = tl.load(data_ptr + byte, mask=byte < nbytes, other=0).to(tl.int32)
    shifts = (tl.arange(0, PER) * BITS)[None, :]
    code = (data[:, None] >> shifts) & ((1 << BITS) - 1)
    out = tl.load(values_ptr + code, mask=m, other=0.0)
    if HAS_F:
        out = out * tl.load(f_ptr + idx // d, mask=m, other=0.0)
    if HAS_LO:
        out = out + tl.load(lo_ptr + idx // d, mask=m, other=0.0)
    tl.store(out_ptr + idx, out, mask=m)


def launch(kernel, programs: int, *args, **meta):
    """``kernel`` on ``programs`` programs (at least one) on the device of its first tensor
    argument (Triton launches on the current device), without fused multiply-adds (the
    chain rounds each product)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    on = torch.cuda.device(first.device) if first is not None and first.is_cuda else nullcontext()
    with on:
        kernel[(max(programs, 1),)](*args, enable_fp_fusion=False, **meta)


@triton.jit
def natural_codes(x_ptr, r_ptr, u_ptr, bad_ptr, powers_ptr, n, nbytes, exps_ptr, signs_ptr,
                  res_ptr, HAS_R: tl.constexpr, BYTES: tl.constexpr, WIDE: tl.constexpr):
    """Natural compression's exponent codes -- the float32 exponent field, plus 1 when
    ``u < mantissa / 2^23``, at most 254; all 255 when ``bad`` (the step's count of NaN/Inf)
    is not 0 -- and its sign bits, 8 a byte; with ``HAS_R`` the new residual ``v -
    powers[code] * (+-1)``."""
    byte, idx = _layout(BYTES, 8, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    bits = x.to(tl.int32, bitcast=True)
    prob = (bits & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07  # 2^-23
    u = tl.load(u_ptr + idx, mask=m, other=0.0)
    e = tl.minimum(((bits >> 23) & 0xFF) + (u < prob).to(tl.int32), 254)
    e = tl.where(tl.load(bad_ptr) > 0, 255, e)
    tl.store(exps_ptr + idx, e.to(tl.uint8), mask=m)
    neg = tl.where(m, (bits < 0).to(tl.int32), 0)
    tl.store(signs_ptr + byte, _pack(neg, 1, 8), mask=byte < nbytes)
    if HAS_R:
        dec = tl.load(powers_ptr + e, mask=m, other=0.0) * tl.where(neg == 1, -1.0, 1.0)
        tl.store(res_ptr + idx, x - dec, mask=m)


@triton.jit
def natural_decode(exps_ptr, signs_ptr, powers_ptr, n, out_ptr, BYTES: tl.constexpr,
                   WIDE: tl.constexpr):
    """``powers[exp] * (+-1)`` (the sign bit 1: -1)."""
    byte, idx = _layout(BYTES, 8, WIDE)
    m = idx < n
    bit = (tl.load(signs_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)[:, None]
           >> tl.arange(0, 8)[None, :]) & 1
    e = tl.load(exps_ptr + idx, mask=m, other=0).to(tl.int32)
    out = tl.load(powers_ptr + e, mask=m, other=0.0) * tl.where(bit == 1, -1.0, 1.0)
    tl.store(out_ptr + idx, out, mask=m)


@triton.jit
def sign_codes(x_ptr, r_ptr, scale_ptr, n, nbytes, signs_ptr, res_ptr, HAS_R: tl.constexpr,
               BYTES: tl.constexpr, WIDE: tl.constexpr):
    """Sign bits (1: ``v >= 0``), 8 a byte; with ``HAS_R`` the new residual ``v -
    (+-scale)``."""
    byte, idx = _layout(BYTES, 8, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    up = tl.where(m, (x >= 0).to(tl.int32), 0)
    tl.store(signs_ptr + byte, _pack(up, 1, 8), mask=byte < nbytes)
    if HAS_R:
        scale = tl.load(scale_ptr)
        tl.store(res_ptr + idx, x - tl.where(up == 1, scale, -scale), mask=m)


@triton.jit
def threshold_codes(x_ptr, r_ptr, n, nbytes, tau, codes_ptr, res_ptr, HAS_R: tl.constexpr,
                    BYTES: tl.constexpr, WIDE: tl.constexpr):
    """2-bit threshold codes (1: ``v >= tau``, 2: ``v <= -tau``, else 0), 4 a byte; with
    ``HAS_R`` the new residual ``v - (+-tau or 0)``."""
    byte, idx = _layout(BYTES, 4, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    code = tl.where(m, (x >= tau).to(tl.int32) + 2 * (x <= -tau).to(tl.int32), 0)
    tl.store(codes_ptr + byte, _pack(code, 2, 4), mask=byte < nbytes)
    if HAS_R:
        dec = tl.where(code == 1, tau, tl.where(code == 2, -1.0 * tau, 0.0 * tau))
        tl.store(res_ptr + idx, x - dec, mask=m)


@triton.jit
def eightbit_codes(x_ptr, r_ptr, inv_ptr, scale_ptr, edges_ptr, levels_ptr, n, codes_ptr,
                   res_ptr, HAS_R: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """8-bit codes: how many of the 255 sorted ``edges`` are ``<= v * inv`` (a binary
    search); with ``HAS_R`` the new residual ``v - levels[code] * scale``."""
    idx = _pid(WIDE) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = _clean(x)
    t = x * tl.load(inv_ptr)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.full([BLOCK], 255, tl.int32)
    for _ in range(8):  # 255 edges: 8 halvings
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(edges_ptr + mid, mask=active, other=0.0) <= t
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & (below == 0), mid, hi)
    tl.store(codes_ptr + idx, lo.to(tl.uint8), mask=m)
    if HAS_R:
        dec = tl.load(levels_ptr + lo, mask=m, other=0.0) * tl.load(scale_ptr)
        tl.store(res_ptr + idx, x - dec, mask=m)


@triton.jit
def eightbit_decode(codes_ptr, levels_ptr, scale_ptr, n, out_ptr, BLOCK: tl.constexpr,
                    WIDE: tl.constexpr):
    """``levels[code] * scale``."""
    idx = _pid(WIDE) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    code = tl.load(codes_ptr + idx, mask=m, other=0).to(tl.int32)
    out = tl.load(levels_ptr + code, mask=m, other=0.0) * tl.load(scale_ptr)
    tl.store(out_ptr + idx, out, mask=m)


@triton.jit
def _lowbias32(x):
    """lowbias32 on uint32 (:func:`hvd_compress.core.sampling.hash32`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def stratified(key0_ptr, key1_ptr, n, k, indices_ptr, sizes_ptr, BLOCK: tl.constexpr):
    """:func:`hvd_compress.core.sampling.stratified_indices`: stratum ``j`` is ``[j*n//k,
    (j+1)*n//k)``, its index ``lo + (h_j * size) >> 32`` for the keyed hash ``h_j``."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < k
    lo = j * n // k
    size = (j + 1) * n // k - lo
    h = _lowbias32((j ^ tl.load(key0_ptr)).to(tl.uint32))
    h = _lowbias32(h ^ tl.load(key1_ptr).to(tl.uint32))
    tl.store(indices_ptr + j, lo + ((h.to(tl.int64) * size) >> 32), mask=m)
    tl.store(sizes_ptr + j, size, mask=m)
