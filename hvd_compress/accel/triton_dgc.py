"""DGC's threshold correction loop and adaptive quantization's sign counts on CUDA
tensors in Triton.

DGC (Lin et al., ICLR 2018) lowers its sampled threshold ``t`` by a factor 0.8 while
fewer than 0.8 k magnitudes reach it, ten rounds at most; on a device the chain runs
all ten rounds (a comparison and a count each: twenty passes over the magnitudes, no
host read).  Here one pass counts, in each program's stretch of magnitudes, those at or
above every candidate ``t_j`` (``t_0 = t``, ``t_j = t_(j-1) * 0.8`` in float32: the
chain's products), and one program adds the stretches' counts and takes the first
candidate that enough reach, else the last lowering: the chain's threshold, left on
the device (nothing is read on the host).

Adaptive quantization (Dryden et al., MLHPC 2016) sends ``ceil(ratio * n+)`` of its
``n+`` positive values and likewise of the negative ones: both counts come from one
pass (each program's counts added atomically into two integers) and one read on the
host, which the payload's size needs (the chain makes two passes and a read per sign).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import launch

_CHUNK = 8192  # magnitudes a counting program takes (fewer partial counts to add)
_BLOCK = 256  # magnitudes it compares with every candidate at a time
_PICK = 256  # stretches' counts the picking program adds at a time
_INT32 = 2 ** 31  # the kernels' indices are int32: longer tensors take the chain


@triton.jit
def _candidates(thr, factor, rows, ROUNDS: tl.constexpr):
    """The thresholds the loop may try, ``thr * factor**j`` (one float32 product at a
    time) at row ``j <= ROUNDS``; rows past it repeat the last (never read)."""
    t = tl.zeros(rows.shape, tl.float32) + thr
    cur = thr
    for j in tl.static_range(1, ROUNDS + 1):
        cur = cur * factor
        t = tl.where(rows >= j, cur, t)
    return t


@triton.jit
def count_reaching(mag_ptr, n, thr_ptr, factor, counts_ptr, ROUNDS: tl.constexpr,
                   ROWS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``counts[program, j]``: the program's magnitudes ``>= t_j`` (``j < ROUNDS``)."""
    rows = tl.arange(0, ROWS)
    t = _candidates(tl.load(thr_ptr), factor, rows, ROUNDS)
    counts = tl.zeros([ROWS], tl.int32)
    start = tl.program_id(0) * CHUNK
    for off in range(0, tl.minimum(n - start, CHUNK), BLOCK):  # (the last stretch is short)
        idx = start + off + tl.arange(0, BLOCK)
        m = idx < n
        x = tl.load(mag_ptr + idx, mask=m, other=0.0)
        hit = (x[None, :] >= t[:, None]) & m[None, :]
        counts += tl.sum(hit.to(tl.int32), 1)
    tl.store(counts_ptr + tl.program_id(0) * ROWS + rows, counts)


@triton.jit
def pick_lowered(counts_ptr, programs, thr_ptr, factor, least, out_ptr, ROUNDS: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``out``: the first ``t_j`` that at least ``least`` magnitudes reach (``j <
    ROUNDS``), else ``t_ROUNDS`` -- where the chain's loop stops lowering."""
    rows = tl.arange(0, ROWS)
    total = tl.zeros([ROWS], tl.int64)
    for start in range(0, programs, BLOCK):
        p = start + tl.arange(0, BLOCK)
        c = tl.load(counts_ptr + p[:, None] * ROWS + rows[None, :],
                    mask=(p < programs)[:, None], other=0)
        total += tl.sum(c.to(tl.int64), 0)
    first = tl.min(tl.where((total >= least) & (rows < ROUNDS), rows, ROUNDS), 0)
    out = tl.load(thr_ptr)
    cur = out
    for j in tl.static_range(1, ROUNDS + 1):
        cur = cur * factor
        out = tl.where(first >= j, cur, out)
    tl.store(out_ptr, out)


@triton.jit
def count_signs(v_ptr, n, counts_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``counts += (values > 0, values < 0)`` of the program's stretch (NaN in neither)."""
    pos = tl.zeros([BLOCK], tl.int32)
    neg = tl.zeros([BLOCK], tl.int32)
    start = tl.program_id(0) * CHUNK
    for off in range(0, tl.minimum(n - start, CHUNK), BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        x = tl.load(v_ptr + idx, mask=idx < n, other=0.0)
        pos += (x > 0).to(tl.int32)
        neg += (x < 0).to(tl.int32)
    tl.atomic_add(counts_ptr, tl.sum(pos, 0).to(tl.int64))
    tl.atomic_add(counts_ptr + 1, tl.sum(neg, 0).to(tl.int64))


def lowered(mag, thr, least: int, rounds: int, factor: float):
    """DGC's correction loop (:meth:`~hvd_compress.core.dgc.DGC.threshold`): ``thr`` (0-d
    float32) times ``factor`` while fewer than ``least`` of the flat float32 ``mag`` are
    ``>= thr``, ``rounds`` times at most, as a 0-d tensor; None (the loop) for other
    dtypes or lengths."""
    n = mag.shape[0]
    if mag.dtype != torch.float32 or thr.dtype != torch.float32 or not 0 < n < _INT32 - _CHUNK \
            or rounds < 0:
        return None
    rows = triton.next_power_of_2(rounds + 1)
    programs = triton.cdiv(n, _CHUNK)
    thr = thr.reshape(1)
    counts = torch.empty((programs, rows), dtype=torch.int32, device=mag.device)
    launch(count_reaching, programs, mag.contiguous(), n, thr, factor, counts, ROUNDS=rounds,
           ROWS=rows, CHUNK=_CHUNK, BLOCK=_BLOCK)
    out = torch.empty((), dtype=torch.float32, device=mag.device)
    launch(pick_lowered, 1, counts, programs, thr, factor, least, out, ROUNDS=rounds,
           ROWS=rows, BLOCK=_PICK)
    return out


def sign_counts(v):
    """How many of the flat float32 ``v`` are positive and negative (Python ints: one read
    on the host), or None (the chain's counts) for other dtypes or lengths."""
    n = v.shape[0]
    if v.dtype != torch.float32 or n >= _INT32 - _CHUNK:
        return None
    counts = torch.zeros(2, dtype=torch.int64, device=v.device)
    launch(count_signs, triton.cdiv(n, _CHUNK), v.contiguous(), n, counts, CHUNK=_CHUNK,
           BLOCK=_BLOCK)
    pos, neg = counts.tolist()
    return pos, neg


def lowering(B, marker, cols):
    """The maker for DGC's marker (:class:`~hvd_compress.core.dgc.Lowering`)."""
    return lowered


def signs(B, marker, cols):
    """The maker for adaptive quantization's marker
    (:class:`~hvd_compress.core.variable.SignCounts`)."""
    return sign_counts
