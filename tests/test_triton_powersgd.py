"""PowerSGD's element-wise kernels (hvd_compress/accel/triton_powersgd.py) against the torch
chain with them off and the numpy reference, step by step with error feedback and warm
start, over a NaN/Inf step and a step whose products overflow: the checks that
tests/test_triton_kernels.py runs in Triton's interpreter and compiles for sm_90 (its
subprocesses import triton), and the CUDA tests, which run where a GPU is.

PowerSGD's payloads are matrix products; numpy's BLAS and torch's round them differently,
so the numpy reference here is the core on numpy with the products, the QR and the
Gaussian draw's transcendentals done by torch on the same device (:class:`TorchProducts`):
every element-wise step (the sum with the residual, ``zero_nonfinite``, the finiteness
flags, the NaN flag, the choice of the residual and of ``q``) is numpy's, and every value
the core keeps or sends must then equal the kernels' bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import warnings
import zlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from hvd_compress.accel import device
from hvd_compress.core import NUMPY, build
from hvd_compress.core.backend import NumpyBackend
from hvd_compress.torch import TorchBackend

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")),
                          reason="no CUDA device (or no triton) on this machine")
#: ranks 1 and 2, with and without error feedback, warm start on and off, over odd shapes
#: (not a multiple of a block; 97 x 101 takes two programs), a 3-d tensor, and tensors
#: sent dense (a vector; a matrix too small to compress at rank 2, compressed at rank 1)
CASES = [("powersgd:rank=1", (40, 30)), ("powersgd:rank=2,seed=3", (97, 101)),
         ("powersgd:rank=2,ef=false", (7, 5, 3)), ("powersgd:rank=1,warm_start=false", (97, 101)),
         ("powersgd:rank=2,ef=false,warm_start=false,seed=7", (40, 30)),
         ("powersgd:rank=2", (3001,)), ("powersgd:rank=2", (3, 2)), ("powersgd:rank=1", (3, 2))]
KERNELS = {"finite_sum", "count_nonfinite", "keep_residual"}
#: the kernels for the sm_90 compile check: (name, argument types, constants)
COMPILED = [("finite_sum", {"bad_ptr": "*i32"}, dict(HAS_R=True, CHUNK=8192, BLOCK=1024)),
            ("finite_sum", {"bad_ptr": "*i32"}, dict(HAS_R=False, CHUNK=8192, BLOCK=1024)),
            ("count_nonfinite", {"bad_ptr": "*i32"}, dict(CHUNK=8192, BLOCK=1024)),
            ("keep_residual", {"bad_ptr": "*i32"}, dict(CHUNK=8192, BLOCK=1024))]


class TorchProducts(NumpyBackend):
    """The numpy backend with the products, the QR and log/cos/sqrt done by torch on
    ``device`` (see the module's doc)."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.T, self.device = TorchBackend(), torch.device(device)

    def _run(self, op, *arrays):
        """``op`` on the arrays as tensors of the same strides: torch's QR gives Q column-major
        and BLAS picks its kernel (and its sums' order) by the operands' layout, so a
        row-major copy of ``P_hat`` rounds ``M^T P_hat`` otherwise than the chain does."""
        out = op(*(torch.from_numpy(_positive(a)).to(self.device) for a in arrays))
        return out.cpu().numpy()  # the strides kept: a column-major Q stays column-major

    def matmul(self, a, b, transpose_a=False, transpose_b=False):
        return self._run(lambda x, y: self.T.matmul(x, y, transpose_a, transpose_b), a, b)

    def subtract_product(self, c, a, b):
        return self._run(self.T.subtract_product, c, a, b)

    def orthonormalize(self, p):
        return self._run(self.T.orthonormalize, p)

    def log(self, x):
        return self._run(torch.log, x)

    def cos(self, x):
        return self._run(torch.cos, x)

    def sqrt(self, x):
        return self._run(torch.sqrt, x)


def _positive(a):
    """``a`` with its strides where torch can take them (none negative), else a copy."""
    a = np.asarray(a)
    return a if all(st >= 0 for st in a.strides) else np.ascontiguousarray(a)


@contextmanager
def kernels_off():
    old = os.environ.get("HVD_COMPRESS_TRITON")
    os.environ["HVD_COMPRESS_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HVD_COMPRESS_TRITON")
        else:
            os.environ["HVD_COMPRESS_TRITON"] = old


def _step(comp, x, other):
    """One step of one rank whose peers' payloads add ``other`` (fixed per round): what
    the core keeps and sends, by name."""
    enc = comp.encode(x, "t")
    got = {"payload": enc.payload}
    if comp.rounds(enc.meta) == 1:
        return {**got, "aggregate": comp.aggregate(enc.payload, enc)}
    like = enc.payload
    got.update(m=enc.ctx.m, finite=enc.ctx.finite, flag=enc.ctx.flag)
    enc = comp.next_round(enc, like + _as(like, other[0][:like.shape[0], :like.shape[1]]))
    like = enc.payload
    got["q_w"] = like
    got["aggregate"] = comp.aggregate(like + _as(like, other[1][:like.shape[0], :like.shape[1]]), enc)
    st = comp.states["t"]
    return {**got, "residual": st.residual, "q": st.q}


def _as(like, a):
    return torch.from_numpy(a).to(like.device) if isinstance(like, torch.Tensor) else a


def _numpy(v):
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def compare(spec, shape, B, to_tensor, device="cpu") -> list[str]:
    """Four steps of ``spec`` on ``shape`` through the kernels (``B``), the chain with them
    off (``B``, ``HVD_COMPRESS_TRITON=0``) and numpy (:class:`TorchProducts` on ``device``):
    a finite step, one with NaN and Inf in the gradient, one whose products overflow (the
    matrix finite, the residual not: the old one kept), a finite one; the differences."""
    new, old, ref = build(spec, B), build(spec, B), build(spec, TorchProducts(device))
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape)).encode()))
    other = [(rng.standard_normal((int(np.prod(shape)), 2)) * 1e-2).astype(np.float32) for _ in range(2)]
    bad = []
    for step in range(4):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        flat = x.reshape(-1)
        if step == 1:
            flat[[1, flat.size - 2]] = [np.nan, -np.inf]
        if step == 2:
            x[...] = 3e38  # M finite, M^T P_hat (about 3e38 sqrt(rows)) not
        got = _step(new, to_tensor(x), other)
        with kernels_off():
            chain = _step(old, to_tensor(x), other)
        want = _step(ref, x, other)
        for key, value in got.items():
            a = _numpy(value)
            for name, b in (("chain", _numpy(chain[key])), ("numpy", _numpy(want[key]))):
                same = a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
                    a, b, equal_nan=a.dtype.kind == "f")
                if not same:
                    bad.append(f"{spec} {shape} step {step}: {key} vs {name}")
    return bad


def launches() -> dict:
    """How often :func:`compare` over :data:`CASES` launches each kernel: four steps of
    each case sent compressed, the last two kernels only with error feedback."""
    packed = [c for c, shape in ((build(spec, NUMPY), shape) for spec, shape in CASES)
              if c.compressed(c.meta_for(np.zeros(shape, np.float32), "t"))]
    ef = 4 * sum(bool(c.ef) for c in packed)
    return {"finite_sum": 4 * len(packed), "count_nonfinite": ef, "keep_residual": ef}


def kernels():
    """The kernels' module (imports triton: for the processes that have it)."""
    from hvd_compress.accel import triton_powersgd
    return triton_powersgd


def interpreter_checks(B) -> list[str]:
    """Every case of :data:`CASES` through the kernels (``B``: a torch backend whose CPU
    tensors take the device path; Triton's interpreter on): the differences found, and one
    more line where the kernels did not run as often as the cases need."""
    tp, ran = kernels(), {}
    launch = tp.launch

    def counted(kernel, *args, **meta):
        ran[kernel.fn.__name__] = ran.get(kernel.fn.__name__, 0) + 1
        return launch(kernel, *args, **meta)

    tp.launch = counted
    try:
        bad = [b for spec, shape in CASES for b in compare(spec, shape, B, torch.from_numpy)]
    finally:
        tp.launch = launch
    if ran != launches():
        bad.append(f"powersgd: kernels launched {ran}, not {launches()}")
    return bad


def test_without_triton_or_switched_off_the_chain_runs(monkeypatch):
    """The hook answers None -- PowerSGD's chain -- where triton is missing (quietly), where
    ``HVD_COMPRESS_TRITON=0`` or ``HVD_COMPRESS_FUSED=0``, for CPU tensors without the
    interpreter, and for backends without the hook (numpy, TensorFlow)."""
    cuda_like = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(device, "_KERNELS", None)
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    comp = build("powersgd", TorchBackend())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert comp.fused(cuda_like) is None and comp.fused(torch.zeros(3)) is None
    monkeypatch.setattr(device, "_KERNELS", types.SimpleNamespace(probe=lambda d: True))
    monkeypatch.setattr(device, "_WORKS", {})
    for name in ("HVD_COMPRESS_TRITON", "HVD_COMPRESS_FUSED"):
        monkeypatch.setenv(name, "0")
        assert device.device_powersgd(cuda_like) is None
        monkeypatch.delenv(name)
    assert device.device_powersgd(torch.zeros(3)) is None
    assert build("powersgd", NUMPY).fused(np.zeros(3, np.float32)) is None


@CUDA
@pytest.mark.parametrize("spec,shape", CASES + [("powersgd:rank=2", (257, 1031)),
                                                ("powersgd:rank=1,ef=false", (1031, 257))])
def test_cuda_powersgd_same_bits(spec, shape):
    """On a GPU: PowerSGD's matrix, payloads, residual, q and aggregate through the
    kernels equal the chain's on the device and numpy's over the same cuBLAS products."""
    assert compare(spec, shape, TorchBackend(), lambda a: torch.from_numpy(a).cuda(), "cuda") == []


@CUDA
def test_cuda_powersgd_passes_do_not_synchronise():
    """PowerSGD's element-wise kernels wait for the GPU nowhere (its QR is the chain's)."""
    tp = kernels()
    x, r, old = (torch.randn(100_003, device="cuda") for _ in range(3))
    finite = tp.finite_matrix(x, r)[1]  # first call: kernels compiled
    tp.keep_finite(x.clone(), old, finite)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m, finite = tp.finite_matrix(x, r)
        kept = tp.keep_finite(m.clone(), old, finite)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite.item() and torch.equal(m, x + r) and torch.equal(kept, m)
