"""PowerSGD's element-wise passes on CUDA tensors in Triton (the matrix products stay
cuBLAS's: their bits are the chain's).

PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019; :mod:`hvd_compress.core.powersgd`)
compresses ``M = x + residual`` with NaN/Inf entries set to 0, and keeps the new residual
``M - P_hat Q_w^T`` only where it and ``M`` were finite.  On a device the torch chain
makes ten passes over the matrix for that besides its four products: the sum, a min/max
for its finiteness, ``isfinite`` (four operations), two selects; then a min/max of the
new residual and a select between it and the old one.  Here:

* :func:`finite_matrix`: one pass writes ``M`` (``x + residual`` with NaN/Inf read as 0:
  the chain's ``zero_nonfinite``) and counts the NaN/Inf entries (each program's count
  added atomically), whence ``finite``, a 0-d tensor;
* :func:`keep_finite`: one pass counts the new residual's NaN/Inf entries (starting from
  1 where ``M`` was not finite), then a second kernel copies the old residual over the
  new one where that count is not 0 -- after a finite step it reads only the count, no
  value is read or written.

Nothing is read on the host.  The sums are the chain's float32 additions, one rounding
each (launches without fused multiply-adds, :func:`~.triton_kernels.launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import INF, launch

_CHUNK = 8192  # values a program takes (fewer atomic additions)
_BLOCK = 1024  # values it takes at a time
_INT32 = 2 ** 31  # the kernels' indices are int32: longer tensors take the chain


@triton.jit
def finite_sum(x_ptr, r_ptr, n, m_ptr, bad_ptr, HAS_R: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):
    """``m = x (+ r)`` with NaN/Inf entries 0; ``bad`` += how many were NaN/Inf."""
    bad = tl.zeros([BLOCK], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        m = idx < n
        v = tl.load(x_ptr + idx, mask=m, other=0.0)
        if HAS_R:
            v = v + tl.load(r_ptr + idx, mask=m, other=0.0)
        fin = tl.abs(v) < INF  # masked entries are 0: finite
        tl.store(m_ptr + idx, tl.where(fin, v, 0.0), mask=m)
        bad += (fin == 0).to(tl.int32)
    tl.atomic_add(bad_ptr, tl.sum(bad, 0))


@triton.jit
def count_nonfinite(v_ptr, n, bad_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``bad`` += how many of the program's values are NaN/Inf."""
    bad = tl.zeros([BLOCK], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + idx, mask=idx < n, other=0.0)
        fin = tl.abs(v) < INF
        bad += (fin == 0).to(tl.int32)
    tl.atomic_add(bad_ptr, tl.sum(bad, 0))


@triton.jit
def keep_residual(new_ptr, old_ptr, n, bad_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``new = old`` where ``bad`` is not 0; else nothing (every access masked off)."""
    keep = (tl.zeros([BLOCK], tl.int32) + tl.load(bad_ptr)) != 0
    for off in range(0, CHUNK, BLOCK):
        idx = tl.program_id(0) * CHUNK + off + tl.arange(0, BLOCK)
        m = (idx < n) & keep
        tl.store(new_ptr + idx, tl.load(old_ptr + idx, mask=m, other=0.0), mask=m)


def _fits(*tensors) -> bool:
    """Flat float32 tensors of one length (int32 indices) on one device: the kernels' own."""
    first = tensors[0]
    n = first.shape[0] if first.dim() == 1 else -1
    return 0 < n < _INT32 - _CHUNK and all(
        t.dtype == torch.float32 and t.shape == first.shape and t.device == first.device
        for t in tensors)


def finite_matrix(x, residual=None):
    """``(m, finite)``: ``m = x + residual`` (``x`` where None; flat float32) with its
    NaN/Inf entries set to 0, a new tensor, and whether there were none (0-d bool) -- the
    core's sum, ``all_finite`` and ``zero_nonfinite``; or None (the chain) for tensors the
    kernel does not take."""
    if not _fits(x, *(() if residual is None else (residual,))):
        return None
    n = x.shape[0]
    x = x.contiguous()
    m = torch.empty_like(x)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch(finite_sum, triton.cdiv(n, _CHUNK), x, x if residual is None else residual.contiguous(),
           n, m, bad, HAS_R=residual is not None, CHUNK=_CHUNK, BLOCK=_BLOCK)
    return m, bad[0] == 0


def keep_finite(new, old, finite):
    """``new`` where it is all finite and ``finite`` (0-d bool) holds, else ``old``:
    ``new`` itself, overwritten by ``old`` in the second case (flat float32 tensors of
    one length); or None (the chain's select) for tensors the kernels do not take."""
    if not _fits(new, old) or not new.is_contiguous():
        return None
    n = new.shape[0]
    if isinstance(finite, torch.Tensor):
        bad = torch.logical_not(finite.to(new.device)).to(torch.int32).reshape(1)
    else:  # a Python bool: no copy to the device to wait for
        bad = torch.full((1,), 0 if finite else 1, dtype=torch.int32, device=new.device)
    programs = triton.cdiv(n, _CHUNK)
    launch(count_nonfinite, programs, new, n, bad, CHUNK=_CHUNK, BLOCK=_BLOCK)
    launch(keep_residual, programs, new, old.contiguous(), n, bad, CHUNK=_CHUNK, BLOCK=_BLOCK)
    return new
