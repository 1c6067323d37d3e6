"""DGC's element-wise passes on CUDA tensors in Triton: the momentum correction and
accumulation, the momentum factor masking, and the state kept after a non-finite step.

DGC (Lin, Han, Mao, Wang & Dally, ICLR 2018; :mod:`hvd_compress.core.dgc`) updates, per
step, ``u = m*u + g`` and ``v = v + u`` (Nesterov: ``u = m*(u + g)``, ``v = v + u + g``;
``g`` clipped first where asked), selects on ``|v|``, then keeps in ``v`` what was not
sent and zeroes ``u`` where values were sent.  On a device the torch chain spends about
fifteen passes over the tensor on that besides the selection: the gradient's finiteness
(a min/max) and ``zero_nonfinite`` (four), the momentum (three), ``abs``, then the sent
values scattered into a dense tensor and subtracted, a dense mask of the sent indices
and a select for ``u``, and a select between the new and the old state for each.  Here:

* :func:`momentum`: one pass reads ``g``, ``u`` and ``v`` and writes the new ``u``, ``v``
  and ``|v|``, with NaN/Inf entries of ``g`` read as 0 (the chain's ``zero_nonfinite``)
  and counted (each program's count added atomically: the step's finiteness stays on the
  device); with clipping a pass before it sums the squares in float64 per program, and
  the core turns their sum into the factor (its own arithmetic on one value);
* :func:`settle`: one program per 1,024 of the ``k`` slots subtracts each sent value
  from ``v`` at its index and zeroes ``u`` there (the chain's dense scatter, subtraction,
  mask and select give these bits at those indices and leave the rest as they are), then
  a pass copies the old ``u`` and ``v`` over the new ones where the NaN/Inf count is not
  0 -- after a finite step each of its programs reads the count alone.

The new state goes into fresh buffers (the old one must survive a non-finite step);
nothing is read on the host.  One rounding per operation, as the chain's (launches
without fused multiply-adds, :func:`~.triton_kernels.launch`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .triton_kernels import INF, launch

_CHUNK = 8192  # values a program takes (fewer atomic additions)
_BLOCK = 1024  # values it takes at a time; slots a masking program takes
_INT32 = 2 ** 31  # the kernels' indices are int32: longer tensors take the chain


@triton.jit
def dgc_clip_sums(g_ptr, n, sums_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``sums[program]``: the float64 sum of the squares of its ``g`` (NaN/Inf as 0)."""
    acc = tl.zeros([BLOCK], tl.float64)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        x = tl.load(g_ptr + idx, mask=idx < n, other=0.0)
        x = tl.where(tl.abs(x) < INF, x, 0.0).to(tl.float64)
        acc += x * x
    tl.store(sums_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def dgc_momentum_step(g_ptr, u_ptr, v_ptr, factor_ptr, m, n, u_out_ptr, v_out_ptr, mag_ptr,
                      bad_ptr, CLIP: tl.constexpr, NESTEROV: tl.constexpr,
                      ACCUMULATE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``u' = u*m + g`` (Nesterov ``(u + g)*m``) and, with ``ACCUMULATE``, ``v' = v + u'``
    (Nesterov ``v + u' + g``) and ``|v'|``; without it, Nesterov's ``u' + g`` into ``v'``
    (momentum alone).  ``g`` with NaN/Inf read as 0, times ``factor`` with ``CLIP``;
    ``bad`` += how many were NaN/Inf."""
    bad = tl.zeros([BLOCK], tl.int32)
    if CLIP:
        f = tl.load(factor_ptr)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        ok = idx < n
        x = tl.load(g_ptr + idx, mask=ok, other=0.0)
        fin = tl.abs(x) < INF  # masked entries are 0: finite
        x = tl.where(fin, x, 0.0)
        if CLIP:
            x = x * f
        u = tl.load(u_ptr + idx, mask=ok, other=0.0)
        if NESTEROV:
            u = (u + x) * m
        else:
            u = u * m + x
        tl.store(u_out_ptr + idx, u, mask=ok)
        if ACCUMULATE:
            v = tl.load(v_ptr + idx, mask=ok, other=0.0) + u
            if NESTEROV:
                v = v + x
            tl.store(v_out_ptr + idx, v, mask=ok)
            tl.store(mag_ptr + idx, tl.abs(v), mask=ok)
        elif NESTEROV:
            tl.store(v_out_ptr + idx, u + x, mask=ok)
        bad += (fin == 0).to(tl.int32)
    tl.atomic_add(bad_ptr, tl.sum(bad, 0))


@triton.jit
def dgc_mask_sent(idx_ptr, valid_ptr, sent_ptr, k, u_ptr, v_ptr, MASK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """At each valid slot's index ``i``: ``v[i] -= 0 + sent`` (the chain subtracts a dense
    tensor of the sent values scattered into zeros: ``-0.0`` arrives as ``+0.0``) and, with
    ``MASK``, ``u[i] = 0``.  The valid indices are distinct: no two programs write one."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = (j < k) & (tl.load(valid_ptr + j, mask=j < k, other=0) != 0)
    i = tl.load(idx_ptr + j, mask=ok, other=0)
    s = tl.load(sent_ptr + j, mask=ok, other=0.0)
    tl.store(v_ptr + i, tl.load(v_ptr + i, mask=ok, other=0.0) - (s + 0.0), mask=ok)
    if MASK:
        tl.store(u_ptr + i, tl.zeros([BLOCK], tl.float32), mask=ok)


@triton.jit
def dgc_keep_old(old_u_ptr, old_v_ptr, u_ptr, v_ptr, bad_ptr, n, HAS_V: tl.constexpr,
                 BLOCK: tl.constexpr):
    """``u = old u`` and ``v = old v`` where ``bad`` (the step's NaN/Inf count) is not 0;
    after a finite step the loads and stores are masked off (each program reads ``bad``)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = (idx < n) & (tl.load(bad_ptr) + tl.zeros([BLOCK], tl.int32) > 0)
    tl.store(u_ptr + idx, tl.load(old_u_ptr + idx, mask=m, other=0.0), mask=m)
    if HAS_V:
        tl.store(v_ptr + idx, tl.load(old_v_ptr + idx, mask=m, other=0.0), mask=m)


@triton.jit
def dgc_count_passing(mag_ptr, thr_ptr, n, cnt_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``cnt`` += how many of the program's magnitudes are ``>= thr``."""
    t = tl.load(thr_ptr)
    cnt = tl.zeros([BLOCK], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        ok = idx < n
        cnt += ((tl.load(mag_ptr + idx, mask=ok, other=0.0) >= t) & ok).to(tl.int32)
    tl.atomic_add(cnt_ptr, tl.sum(cnt, 0))


@triton.jit
def dgc_candidate_keys(mag_ptr, thr_ptr, cnt_ptr, cap, n, key_ptr, BLOCK: tl.constexpr):
    """``key = mag`` where ``mag >= thr`` or more than ``cap`` pass (``cnt``), else -1."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(mag_ptr + idx, mask=ok, other=0.0)
    keep = (x >= tl.load(thr_ptr)) | (tl.load(cnt_ptr) + tl.zeros([BLOCK], tl.int32) > cap)
    tl.store(key_ptr + idx, tl.where(keep, x, -1.0), mask=ok)


def _fits(*tensors) -> bool:
    return all(t.dtype == torch.float32 for t in tensors) and \
        0 < tensors[0].shape[0] < _INT32 - _CHUNK


def momentum(g, u, v, m: float, nesterov: bool, factor_of=None):
    """DGC's momentum correction (:meth:`~hvd_compress.core.dgc.DGC.momentum_step`) on flat
    float32 ``g`` with the state ``u`` and, to accumulate, ``v`` (None: momentum alone):
    ``(u', v', |v'| or None, bad)`` -- new tensors, ``v'`` is ``u'`` itself for momentum
    alone without Nesterov, ``bad`` the NaN/Inf count of ``g`` (int32[1]) -- or None (the
    chain) for other dtypes or lengths.  ``factor_of`` (clipping): the float64 sum of the
    squares of ``g`` (0-d) -> the float32 factor ``g`` is multiplied by (0-d)."""
    n = g.shape[0]
    if not _fits(g, u, *(() if v is None else (v,))):
        return None
    programs = triton.cdiv(n, _CHUNK)
    g, u = g.contiguous(), u.contiguous()
    factor = g  # (not read without clipping)
    if factor_of is not None:
        sums = torch.empty(programs, dtype=torch.float64, device=g.device)
        launch(dgc_clip_sums, programs, g, n, sums, CHUNK=_CHUNK, BLOCK=_BLOCK)
        factor = factor_of(sums.sum()).reshape(1).to(torch.float32)
    accumulate = v is not None
    u_new = torch.empty_like(u)
    v_new = torch.empty_like(u) if accumulate or nesterov else u_new
    mag = torch.empty_like(u) if accumulate else None
    bad = torch.zeros(1, dtype=torch.int32, device=g.device)
    launch(dgc_momentum_step, programs, g, u, v.contiguous() if accumulate else u, factor,
           float(m), n, u_new, v_new, u_new if mag is None else mag, bad,
           CLIP=factor_of is not None, NESTEROV=bool(nesterov), ACCUMULATE=accumulate,
           CHUNK=_CHUNK, BLOCK=_BLOCK)
    return u_new, v_new, mag, bad


def settle(u, v, old_u, old_v, bad, sent=None, masking=False):
    """The state DGC keeps (:meth:`~hvd_compress.core.dgc.DGC.settle`), in place on the fresh
    ``u`` and ``v`` of :func:`momentum`: with ``sent`` -- ``(indices int64[k], valid
    bool[k], values float32[k])``, the valid indices distinct -- ``v[i] -= values`` and with
    ``masking`` ``u[i] = 0`` at each valid slot; then the old ``u`` and ``v`` (``v`` None:
    ``u`` alone) where ``bad`` is not 0."""
    n = u.shape[0]
    if sent is not None:
        idx, valid, values = sent
        k = idx.shape[0]
        launch(dgc_mask_sent, triton.cdiv(k, _BLOCK), idx.contiguous(),
               valid.contiguous().view(torch.uint8), values.contiguous(), k, u, v,
               MASK=bool(masking), BLOCK=_BLOCK)
    launch(dgc_keep_old, triton.cdiv(n, _BLOCK), old_u, u if v is None else old_v, u,
           u if v is None else v, bad, n, HAS_V=v is not None, BLOCK=_BLOCK)
    return u, v


def candidate_keys(mag, thr, cap: int):
    """DGC's choice among the magnitudes that pass (:meth:`~hvd_compress.core.dgc.DGC._select`)
    as one key for one top-k: ``(key, over)`` -- ``key`` is ``mag`` where more than ``cap``
    pass ``thr`` (0-d ``over``), else ``mag`` where it passes and -1 elsewhere -- or None
    (the chain) for other dtypes or lengths.  One pass counts, one writes the keys."""
    n = mag.shape[0]
    if not _fits(mag) or thr.dtype != torch.float32 or cap >= _INT32:
        return None
    thr, mag = thr.reshape(1), mag.contiguous()
    cnt = torch.zeros(1, dtype=torch.int32, device=mag.device)
    launch(dgc_count_passing, triton.cdiv(n, _CHUNK), mag, thr, n, cnt, CHUNK=_CHUNK, BLOCK=_BLOCK)
    key = torch.empty_like(mag)
    launch(dgc_candidate_keys, triton.cdiv(n, _BLOCK), mag, thr, cnt, cap, n, key, BLOCK=_BLOCK)
    return key, (cnt > cap).reshape(())


_PASSES = SimpleNamespace(momentum=momentum, settle=settle, candidate_keys=candidate_keys)


def passes(B, marker, cols):
    """The maker for DGC's marker (:class:`~hvd_compress.core.dgc.MomentumPasses`): its
    :func:`momentum` and :func:`settle`."""
    return _PASSES
