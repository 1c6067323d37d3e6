"""INCEPTIONN on CUDA tensors in Triton: a counting pass and a packing pass to encode, a
counting pass over the width codes and a gathering pass to decode (the chain makes
three ``nonzero`` selections, gathers, float64 copies and a scatter each way).

Each program takes :data:`_VALUES` values: the first pass counts each width in it (and
the NaN/Inf entries), a cumulative sum of those counts on the device gives every
program where its values of each width go, and the second pass ranks its values of a
width by a cumulative sum within the program.  The payload's size depends on the
counts, so they are read on the host once (the chain reads them too, its selections
wait for the device as well).  A non-finite step goes to the core's reference step;
with error feedback, the chain (as on the host).  The chain's roundings: ``q =
floor(float64(v) / step + 0.5)`` in float64, decoded values ``float32(q * step)``.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..core.bitpack import packed_nbytes
from .triton_kernels import launch

INF = tl.constexpr(float("inf"))  # a jit function reads constexpr globals only
_VALUES = 1024  # values a program takes (a multiple of 4: whole bytes of width codes)
_INT32 = 2 ** 31  # the kernels' indices are int32: longer tensors take the chain


@triton.jit
def _widths(x, inv):
    """Each value's ``q`` (float64) and width: 0 for q = 0, 1 for |q| <= 127, 2 for |q| <=
    32767, else 3."""
    q = tl.floor(x.to(tl.float64) * inv + 0.5)
    a = tl.abs(q)
    return q, (a > 0).to(tl.int32) + (a > 127).to(tl.int32) + (a > 32767).to(tl.int32)


@triton.jit
def count_widths(x_ptr, n, inv_ptr, counts_ptr, VALUES: tl.constexpr):
    """``counts[program] = (width 3, width 2, width 1, not finite)`` of its values."""
    pid = tl.program_id(0)
    inv = tl.load(inv_ptr)
    idx = pid * VALUES + tl.arange(0, VALUES)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    _, w = _widths(x, inv)
    w = tl.where(m, w, 0)
    tl.store(counts_ptr + pid * 4 + 0, tl.sum((w == 3).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 1, tl.sum((w == 2).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 2, tl.sum((w == 1).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 3, tl.sum((m & ((tl.abs(x) < INF) == 0)).to(tl.int32), 0))


@triton.jit
def _ranks(w, width, start_ptr):
    """Where each value of ``width`` goes: the program's start plus its rank among them."""
    sel = (w == width).to(tl.int32)
    return tl.load(start_ptr) + tl.cumsum(sel, 0) - sel, sel == 1


@triton.jit
def pack(x_ptr, n, inv_ptr, starts_ptr, wide_ptr, mid_ptr, low_ptr, codes_ptr, nbytes,
         VALUES: tl.constexpr):
    """Each value into its width's array at its place (float32, int16 q, uint8 q + 128),
    and the width codes, 2 bits a value, 4 a byte."""
    pid = tl.program_id(0)
    inv = tl.load(inv_ptr)
    idx = pid * VALUES + tl.arange(0, VALUES)
    m = idx < n
    x = tl.load(x_ptr + idx, mask=m, other=0.0)
    q, w = _widths(x, inv)
    w = tl.where(m, w, 0)
    at, sel = _ranks(w, 3, starts_ptr + pid * 4 + 0)
    tl.store(wide_ptr + at, x, mask=sel)
    at, sel = _ranks(w, 2, starts_ptr + pid * 4 + 1)
    tl.store(mid_ptr + at, tl.where(sel, q, 0.0).to(tl.int32).to(tl.int16), mask=sel)
    at, sel = _ranks(w, 1, starts_ptr + pid * 4 + 2)
    tl.store(low_ptr + at, (tl.where(sel, q, 0.0) + 128.0).to(tl.int32).to(tl.uint8), mask=sel)
    byte = pid * (VALUES // 4) + tl.arange(0, VALUES // 4)
    j = byte[:, None] * 4 + tl.arange(0, 4)[None, :]
    xj = tl.load(x_ptr + j, mask=j < n, other=0.0)
    _, wj = _widths(xj, inv)
    wj = tl.where(j < n, wj, 0)
    tl.store(codes_ptr + byte, tl.sum(wj << (tl.arange(0, 4) * 2)[None, :], 1).to(tl.uint8),
             mask=byte < nbytes)


@triton.jit
def _code_widths(codes_ptr, n, VALUES: tl.constexpr):
    """The program's values' widths, read from their 2-bit codes."""
    pid = tl.program_id(0)
    idx = pid * VALUES + tl.arange(0, VALUES)
    byte = tl.load(codes_ptr + idx // 4, mask=idx < n, other=0).to(tl.int32)
    return pid, idx, tl.where(idx < n, (byte >> ((idx % 4) * 2)) & 3, 0)


@triton.jit
def count_codes(codes_ptr, n, counts_ptr, VALUES: tl.constexpr):
    """``counts[program] = (width 3, width 2, width 1, 0)`` from the width codes."""
    pid, idx, w = _code_widths(codes_ptr, n, VALUES)
    tl.store(counts_ptr + pid * 4 + 0, tl.sum((w == 3).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 1, tl.sum((w == 2).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 2, tl.sum((w == 1).to(tl.int32), 0))
    tl.store(counts_ptr + pid * 4 + 3, 0)


@triton.jit
def unpack(codes_ptr, n, step_ptr, starts_ptr, wide_ptr, mid_ptr, low_ptr, out_ptr,
           VALUES: tl.constexpr):
    """The dense values: float32 as sent, ``float32(q * step)`` for the 16- and 8-bit
    ones, 0 for the rest."""
    pid, idx, w = _code_widths(codes_ptr, n, VALUES)
    step = tl.load(step_ptr)
    at, sel = _ranks(w, 3, starts_ptr + pid * 4 + 0)
    out = tl.where(sel, tl.load(wide_ptr + at, mask=sel, other=0.0), 0.0)
    at, sel = _ranks(w, 2, starts_ptr + pid * 4 + 1)
    q = tl.load(mid_ptr + at, mask=sel, other=0).to(tl.float64)
    out = tl.where(sel, (q * step).to(tl.float32), out)
    at, sel = _ranks(w, 1, starts_ptr + pid * 4 + 2)
    q = tl.load(low_ptr + at, mask=sel, other=0).to(tl.int32).to(tl.float64) - 128.0
    out = tl.where(sel, (q * step).to(tl.float32), out)
    tl.store(out_ptr + idx, out, mask=idx < n)


def _launch(kernel, programs, *args):
    launch(kernel, programs, *args, VALUES=_VALUES)


def _float64(value, like):
    """``value`` as a float64 scalar on ``like``'s device (a Python float argument would
    reach the kernel as float32)."""
    return torch.full((1,), value, dtype=torch.float64, device=like.device)


def _starts(counts):
    """Where each program's values of each width start (exclusive cumulative sums)."""
    return (torch.cumsum(counts, 0) - counts).to(torch.int32).contiguous()


def encoder(B, comp, cols):
    """INCEPTIONN's whole payload (``PayloadFastPath``); with error feedback: the chain."""
    if comp.ef:
        return None
    inv = 1.0 / comp.step

    def encode(g, residual, noise, noise_source):
        n = g.shape[0]
        if n + _VALUES >= _INT32:  # the kernels index in int32: the chain
            return None, None, False
        programs = -(-n // _VALUES)
        counts = torch.empty((programs, 4), dtype=torch.int32, device=g.device)
        inv64 = _float64(inv, g)
        _launch(count_widths, programs, g, n, inv64, counts)
        n32, n16, n8, bad = (int(c) for c in counts.sum(0).tolist())  # the payload's size
        if bad:
            return None, None, False  # the core's reference step for NaN/Inf
        ncodes = packed_nbytes(n, 2)
        payload = torch.empty(12 + 4 * n32 + 2 * n16 + n8 + ncodes, dtype=torch.uint8,
                              device=g.device)
        payload[:4].view(torch.float32).fill_(1.0)
        head = payload[4:12].view(torch.int32)
        head[0], head[1] = n32, n16
        at = 12 + 4 * n32
        wide = payload[12:at].view(torch.float32)
        mid = payload[at:at + 2 * n16].view(torch.int16)
        low, codes = payload[at + 2 * n16:at + 2 * n16 + n8], payload[payload.shape[0] - ncodes:]
        _launch(pack, programs, g, n, inv64, _starts(counts), wide, mid, low, codes, ncodes)
        return {"payload": payload}, None, True
    return encode


def decoder(B, comp, cols):
    """INCEPTIONN's dense values from a payload; None (the chain) for a non-finite step's."""
    step = comp.step

    def decode(fields, n):
        if n + _VALUES >= _INT32:  # the kernels index in int32: the chain
            return None
        p = fields["payload"]
        if p.storage_offset() % 4:  # a row of a gathered buffer: its floats aligned
            p = p.clone()
        flag, n32, n16 = p[:12].view(torch.int32).tolist()  # the sizes, read as the chain does
        if not np.isfinite(np.asarray([flag], np.int32).view(np.float32)[0]):
            return None
        programs = -(-n // _VALUES)
        ncodes = packed_nbytes(n, 2)
        codes = p[p.shape[0] - ncodes:]
        counts = torch.empty((programs, 4), dtype=torch.int32, device=p.device)
        _launch(count_codes, programs, codes, n, counts)
        at = 12 + 4 * n32
        wide = p[12:at].view(torch.float32)
        mid = p[at:at + 2 * n16].view(torch.int16)
        low = p[at + 2 * n16:p.shape[0] - ncodes]
        out = torch.empty(n, dtype=torch.float32, device=p.device)
        _launch(unpack, programs, codes, n, _float64(step, p), _starts(counts), wide, mid, low, out)
        return out
    return decode
