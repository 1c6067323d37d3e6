"""The sign family on CUDA tensors in Triton: Signum's step, 1-bit SGD's (by columns too)
and threshold-v's, each a pass or two where the torch chain makes many (importing this
imports triton).

- **Signum** (Bernstein et al., ICML 2018): one pass reads the gradient and the momentum
  and writes the new momentum ``beta * m + (1 - beta) * g`` into a fresh buffer (the old
  one stays after a non-finite step), its sign bits, and per program max |m| and the
  count of NaN/Inf entries; the scale (1, or 0 for an all-zero momentum) and finiteness
  are those few values' reductions, on the device, and a pass that reads only the count
  after a finite step copies the old momentum back after a non-finite one.
- **1-bit SGD** (Seide et al., Interspeech 2014): a statistics pass over tiles of the
  ``rows x cols`` matrix -- per column and chunk of rows the count of values >= 0, the
  float64 sums of the values and of the non-negative ones, the NaN/Inf count -- whose
  partial sums are added on the device; each column's means by the codec's own helper
  (:meth:`~hvd_compress.core.onebit.OneBitCodec.means`); then one pass for the sign bits
  and the residual ``v - (pos or neg)[column]``.  Decoding by columns is one pass (one
  column decodes through the packed codes' kernel).
- **threshold-v** (Strom, Interspeech 2015): a pass counting per program the values with
  ``|v| > tau`` and the NaN/Inf entries, the counts read on the host (the payload's size:
  the chain's ``nonzero`` waits for the device too), then a pass that writes every sent
  value and its index at its place (exclusive sums of the counts, ranks within a program)
  and the residual (0 where sent).  A non-finite step, and tensors past int32 indices,
  take the chain.

The chain's bits: the kernels reuse :mod:`.triton_kernels`' helpers (layout, NaN/Inf read
as 0, bit packing) and launch (no fused multiply-adds); float64 sums are added in another
order than the chain's (as the other statistics passes'), the float32 means after them
the same (tested).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.bitpack import packed_nbytes
from . import triton_kernels as K

_BYTES = 128  # sign bytes a program of the one-pass kernels writes (1,024 values)
_VALUES = 1024  # values a program of threshold-v's passes takes
_TILE = 1024  # values of a column-statistics tile (rows x columns)
_CHUNK = 8192  # values of a column-statistics program (a chunk of rows x its columns)


def _launch(kernel, programs: int, *args, **meta):
    K.launch(kernel, programs, *args, **meta)


def _wide(n: int) -> bool:
    """Whether indices of ``n`` values (with a program's margin) may pass int32."""
    return n + 2 * _CHUNK >= 2**31


@triton.jit
def signum_step(g_ptr, m_ptr, beta, gamma, n, nbytes, fresh_ptr, signs_ptr, top_ptr, bad_ptr,
                BYTES: tl.constexpr, WIDE: tl.constexpr):
    """Signum's momentum ``m * beta + g * gamma`` (as computed, into ``fresh``), its sign
    bits (1: >= 0, NaN/Inf read as 0), 8 a byte, and the program's max |m| and count of
    NaN/Inf entries."""
    byte, idx = K._layout(BYTES, 8, WIDE)
    m = idx < n
    g = tl.load(g_ptr + idx, mask=m, other=0.0)
    mom = tl.load(m_ptr + idx, mask=m, other=0.0)
    mom = mom * beta + g * gamma
    tl.store(fresh_ptr + idx, mom, mask=m)
    x, fin = K._clean(mom)
    up = tl.where(m, (x >= 0).to(tl.int32), 0)
    tl.store(signs_ptr + byte, K._pack(up, 1, 8), mask=byte < nbytes)
    pid = K._pid(WIDE)
    tl.store(top_ptr + pid, tl.max(tl.max(tl.abs(x), 1), 0))
    tl.store(bad_ptr + pid, tl.sum(tl.sum((m & (fin == 0)).to(tl.int32), 1), 0))


@triton.jit
def keep_old(old_ptr, fresh_ptr, bad_ptr, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """``fresh = old`` where ``bad`` (the step's NaN/Inf count) is not 0; after a finite
    step the loads and stores are masked off: each program reads the count alone."""
    idx = K._pid(WIDE) * BLOCK + tl.arange(0, BLOCK)
    m = (idx < n) & (tl.load(bad_ptr) + tl.zeros([BLOCK], tl.int32) > 0)
    tl.store(fresh_ptr + idx, tl.load(old_ptr + idx, mask=m, other=0.0), mask=m)


@triton.jit
def column_sums(x_ptr, r_ptr, rows, cols, chunk, ncb, npos_ptr, total_ptr, spos_ptr, bad_ptr,
                HAS_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                WIDE: tl.constexpr):
    """Per column of the ``rows x cols`` matrix of ``v = x (+ r)`` (NaN/Inf read as 0) and
    per chunk of ``chunk`` rows (a multiple of ``BLOCK_R``; program ``p`` takes chunk ``p //
    ncb`` of column block ``p % ncb``): the count of values >= 0, the float64 sums of the
    values and of the non-negative ones, and the count of NaN/Inf entries, stored at
    ``[chunk, column]``."""
    pid = K._pid(WIDE)
    rc = pid // ncb
    c = (pid % ncb) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < cols
    npos = tl.zeros([BLOCK_R, BLOCK_C], tl.int32)
    bad = tl.zeros([BLOCK_R, BLOCK_C], tl.int32)
    total = tl.zeros([BLOCK_R, BLOCK_C], tl.float64)
    spos = tl.zeros([BLOCK_R, BLOCK_C], tl.float64)
    for off in range(0, chunk, BLOCK_R):
        r = rc * chunk + off + tl.arange(0, BLOCK_R)
        m = (r < rows)[:, None] & cm[None, :]
        idx = r[:, None] * cols + c[None, :]
        x = tl.load(x_ptr + idx, mask=m, other=0.0)
        if HAS_R:
            x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
        x, fin = K._clean(x)
        bad += (m & (fin == 0)).to(tl.int32)
        npos += (m & (x >= 0)).to(tl.int32)
        x64 = x.to(tl.float64)
        total += x64
        spos += tl.where(x64 > 0, x64, 0.0)
    at = rc * cols + c
    tl.store(npos_ptr + at, tl.sum(npos, 0), mask=cm)
    tl.store(bad_ptr + at, tl.sum(bad, 0), mask=cm)
    tl.store(total_ptr + at, tl.sum(total, 0), mask=cm)
    tl.store(spos_ptr + at, tl.sum(spos, 0), mask=cm)


@triton.jit
def onebit_codes(x_ptr, r_ptr, pos_ptr, neg_ptr, n, nbytes, cols, signs_ptr, res_ptr,
                 HAS_R: tl.constexpr, BYTES: tl.constexpr, WIDE: tl.constexpr):
    """Sign bits of ``v = x (+ r)`` (1: >= 0), 8 a byte; with ``HAS_R`` the new residual
    ``v - (pos or neg)[i % cols]``."""
    byte, idx = K._layout(BYTES, 8, WIDE)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = K._clean(x)
    up = tl.where(m, (x >= 0).to(tl.int32), 0)
    tl.store(signs_ptr + byte, K._pack(up, 1, 8), mask=byte < nbytes)
    if HAS_R:
        c = idx % cols
        pos = tl.load(pos_ptr + c, mask=m, other=0.0)
        neg = tl.load(neg_ptr + c, mask=m, other=0.0)
        tl.store(res_ptr + idx, x - tl.where(up == 1, pos, neg), mask=m)


@triton.jit
def onebit_decode(signs_ptr, neg_ptr, pos_ptr, n, cols, out_ptr, BYTES: tl.constexpr,
                  WIDE: tl.constexpr):
    """``pos[i % cols]`` where the sign bit is 1, else ``neg[i % cols]``."""
    byte, idx = K._layout(BYTES, 8, WIDE)
    m = idx < n
    bit = (tl.load(signs_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)[:, None]
           >> tl.arange(0, 8)[None, :]) & 1
    c = idx % cols
    out = tl.where(bit == 1, tl.load(pos_ptr + c, mask=m, other=0.0),
                   tl.load(neg_ptr + c, mask=m, other=0.0))
    tl.store(out_ptr + idx, out, mask=m)


@triton.jit
def _with_residual(x_ptr, r_ptr, n, HAS_R: tl.constexpr, VALUES: tl.constexpr):
    """This program's indices, their mask, ``v = x (+ r)`` with NaN/Inf read as 0 and where
    it was finite: what threshold-v's count and pick passes both start from."""
    idx = tl.program_id(0) * VALUES + tl.arange(0, VALUES)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + idx, mask=m, other=0.0)
    x, fin = K._clean(x)
    return idx, m, x, fin


@triton.jit
def threshold_count(x_ptr, r_ptr, n, tau, counts_ptr, HAS_R: tl.constexpr,
                    VALUES: tl.constexpr):
    """``counts[program] = (values with |v| > tau, NaN/Inf entries)`` of ``v = x (+ r)``."""
    pid = tl.program_id(0)
    idx, m, x, fin = _with_residual(x_ptr, r_ptr, n, HAS_R, VALUES)
    tl.store(counts_ptr + pid * 2, tl.sum((m & (tl.abs(x) > tau)).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 2 + 1, tl.sum((m & (fin == 0)).to(tl.int32), 0))


@triton.jit
def threshold_pick(x_ptr, r_ptr, n, tau, starts_ptr, vals_ptr, idx_ptr, res_ptr,
                   HAS_R: tl.constexpr, VALUES: tl.constexpr):
    """Every value with ``|v| > tau`` and its index (int32) at the program's start plus its
    rank among the program's; with ``HAS_R`` the residual, 0 where sent."""
    pid = tl.program_id(0)
    idx, m, x, fin = _with_residual(x_ptr, r_ptr, n, HAS_R, VALUES)
    sel = (m & (tl.abs(x) > tau)).to(tl.int32)
    at = tl.load(starts_ptr + pid) + tl.cumsum(sel, 0) - sel
    tl.store(vals_ptr + at, x, mask=sel == 1)
    tl.store(idx_ptr + at, idx, mask=sel == 1)
    if HAS_R:
        tl.store(res_ptr + idx, tl.where(sel == 1, 0.0, x), mask=m)


def signum_encoder(B, codec, cols):
    """Signum's fused step (``SignumCodec``): ``(g, momentum, noise, source) -> (fields,
    momentum to keep, finite)``: the new momentum, or after a non-finite step the old one
    (copied back by a pass that reads only the count after a finite step, where a select
    would read both); finite a 0-d tensor (the core flags the scale with it)."""
    beta, gamma = codec.beta, 1.0 - codec.beta  # float32 in the kernel, as in the chain

    def encode(g, momentum, noise, noise_source):
        n = g.shape[0]
        fresh = torch.empty_like(g)
        signs = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=g.device)
        programs = max(1, -(-signs.shape[0] // _BYTES))
        top = torch.empty(programs, dtype=torch.float32, device=g.device)
        bad = torch.empty(programs, dtype=torch.int32, device=g.device)
        old = momentum.contiguous()
        _launch(signum_step, programs, g, old, beta, gamma, n, signs.shape[0], fresh, signs, top,
                bad, BYTES=_BYTES, WIDE=_wide(n))
        bad = bad.amax()
        _launch(keep_old, -(-n // _VALUES), old, fresh, bad, n, BLOCK=_VALUES, WIDE=_wide(n))
        scale = B.cast(top.amax() > 0, "float32").reshape(1)  # 0 for an all-zero momentum
        return {"scale": scale, "signs": signs}, fresh, bad == 0
    return encode


def _column_stats(x, r, cols: int):
    """``(npos int64[cols], total, spos float64[cols], bad)`` of the ``rows x cols`` matrix
    of ``x (+ r)``: partial sums per chunk of rows, added here."""
    rows = x.shape[0] // cols
    block_c = min(triton.next_power_of_2(cols), 128)
    block_r = _TILE // block_c
    chunk = _CHUNK // block_c  # rows a program: a multiple of block_r
    nrc, ncb = max(1, -(-rows // chunk)), -(-cols // block_c)
    npos = torch.empty((nrc, cols), dtype=torch.int32, device=x.device)
    bad = torch.empty((nrc, cols), dtype=torch.int32, device=x.device)
    total = torch.empty((nrc, cols), dtype=torch.float64, device=x.device)
    spos = torch.empty((nrc, cols), dtype=torch.float64, device=x.device)
    _launch(column_sums, nrc * ncb, x, x if r is None else r, rows, cols, chunk, ncb, npos, total,
            spos, bad, HAS_R=r is not None, BLOCK_R=block_r, BLOCK_C=block_c,
            WIDE=_wide(x.shape[0]))
    return npos.sum(0, dtype=torch.int64), total.sum(0), spos.sum(0), bad


def onebit_encoder(B, codec, cols):
    """1-bit SGD's fused step, whole tensor or by columns: the column statistics, the means
    by the codec's helper, then the sign bits and the residual in one pass."""
    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        npos, total, spos, bad = _column_stats(g, residual, cols)
        pos, neg = codec.means(B, npos, spos, total - spos, n // cols, cols)
        signs = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=g.device)
        res = torch.empty_like(g) if residual is not None else None
        _launch(onebit_codes, -(-signs.shape[0] // _BYTES), g,
                g if residual is None else residual, pos, neg, n, signs.shape[0], cols, signs,
                signs if res is None else res, HAS_R=residual is not None, BYTES=_BYTES,
                WIDE=_wide(n))
        return {"pos": pos, "neg": neg, "signs": signs}, res, bad.amax() == 0
    return encode


def onebit_decoder(B, codec, cols):
    """1-bit SGD by columns, one pass; one column: None (the packed codes' kernel)."""
    if cols == 1:
        return None

    def decode(fields, n):
        signs = fields["signs"].contiguous()
        out = torch.empty(n, dtype=torch.float32, device=signs.device)
        _launch(onebit_decode, -(-n // (8 * _BYTES)), signs, fields["neg"].contiguous(),
                fields["pos"].contiguous(), n, cols, out, BYTES=_BYTES, WIDE=_wide(n))
        return out
    return decode


def threshold_v_encoder(B, comp, cols):
    """Threshold-v's whole payload (``PayloadFastPath``): ``flag (1.0), values float32[k],
    indices int32[k]`` and the residual; None (the chain) for a non-finite step and for
    tensors whose indices pass int32."""
    tau = float(comp.params["tau"])

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        if n + _VALUES >= 2**31:  # int64 indices: the chain
            return None
        programs = max(1, -(-n // _VALUES))
        r = g if residual is None else residual
        counts = torch.empty((programs, 2), dtype=torch.int32, device=g.device)
        _launch(threshold_count, programs, g, r, n, tau, counts, HAS_R=residual is not None,
                VALUES=_VALUES)
        k, bad = (int(c) for c in counts.sum(0).tolist())  # the payload's size
        if bad:
            return None  # the chain's non-finite step
        payload = torch.empty(4 + 8 * k, dtype=torch.uint8, device=g.device)
        payload[:4].view(torch.float32).fill_(1.0)
        starts = (torch.cumsum(counts[:, 0], 0) - counts[:, 0]).to(torch.int32)
        res = torch.empty_like(g) if residual is not None else None
        _launch(threshold_pick, programs, g, r, n, tau, starts,
                payload[4:4 + 4 * k].view(torch.float32), payload[4 + 4 * k:].view(torch.int32),
                g if res is None else res, HAS_R=residual is not None, VALUES=_VALUES)
        return {"payload": payload}, res, True
    return encode
