"""The step that must not wait for the device, for tests/test_triton_kernels.py: the specs whose
encode and aggregate through the kernels read nothing on the host and copy no host data to the
device (the CUDA test checks it with ``torch.cuda.set_sync_debug_mode("error")``), and the
interpreter's stand-in on CPU: the same steps with every host-to-device conversion and every
host read of a tensor that the package's own code makes recorded (:func:`recording`).  The
H200's first run found TernGrad's decode copying a Python list to the device; this catches
that kind where there is no GPU.  Kept here so that the shared test module stays within its
size.

What the CPU stand-in cannot see: branches taken only on a device (the torch backend's
``device.type == "cpu"`` alternatives, which it leaves out as host arithmetic by design), and
syncs inside torch's own device operations; the CUDA test sees those."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from hvd_compress.core import build
from hvd_compress.torch.backend import TorchBackend
from tests import triton_dgc_cases as DGCM
from tests import triton_signs_cases as SIGNS

SPECS = ("qsgd", "terngrad", "uniform", "qsgd:ef=true", "natural", "efsignsgd", "threshold",
         "eightbit:ef=true", "randomk", "sketchml:ef=true") + SIGNS.SYNC_FREE + DGCM.SYNC_FREE
_PKG = Path(__file__).resolve().parent.parent / "hvd_compress"
#: the package's code whose tensor reads would wait for a device (the torch backend's own
#: numpy arithmetic runs only on CPU tensors: left out)
WATCHED = (str(_PKG / "core") + "/", str(_PKG / "accel") + "/")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy",
         "__array__")
MAKERS = ("tensor", "as_tensor", "from_numpy")
#: a size that depends on the data (the host waits to learn it): from anywhere in the package
#: (the backend's own use is behind ``is_host``, which the device path answers False)
SIZED = ("nonzero", "masked_select", "unique")


def step(comp, x):
    """One step of one rank: encode, then the aggregate of its own payload (the allreduced
    payload itself where the compressor's payloads add, else the list of gathered ones)."""
    enc = comp.encode(x, "t")
    comp.aggregate(enc.payload if comp.summable else [enc.payload], enc)


def _watched(frame, within=WATCHED) -> bool:
    return frame.f_code.co_filename.startswith(within)


def _where(frame) -> str:
    path = Path(frame.f_code.co_filename)
    return f"{path.relative_to(_PKG.parent) if path.is_relative_to(_PKG.parent) else path}:{frame.f_lineno}"


@contextmanager
def recording(found: list):
    """Within: ``found`` gets ``"<what> at <file>:<line>"`` for each host list or array the
    torch backend's ``asarray`` puts beside a tensor (``like=``), each tensor the package's
    code makes from host data or a data-dependent size, and each tensor it reads on the host."""
    saved = []

    def patch(owner, name, wrapper):
        saved.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else None))
        setattr(owner, name, wrapper)

    def asarray(self, x, dtype=None, like=None, _orig=TorchBackend.asarray):
        if not isinstance(x, torch.Tensor) and isinstance(like, torch.Tensor):
            found.append(f"B.asarray of host {type(x).__name__} at {_where(sys._getframe(1))}")
        return _orig(self, x, dtype, like)

    def read(name, orig, within=WATCHED):
        def wrapper(*args, **kwargs):
            if _watched(sys._getframe(1), within):
                found.append(f"Tensor.{name} at {_where(sys._getframe(1))}")
            return orig(*args, **kwargs)
        return wrapper

    def make(name, orig, within=WATCHED):
        def wrapper(*args, **kwargs):
            host = not (name == "as_tensor" and args and isinstance(args[0], torch.Tensor))
            if host and _watched(sys._getframe(1), within):
                found.append(f"torch.{name} at {_where(sys._getframe(1))}")
            return orig(*args, **kwargs)
        return wrapper

    try:
        patch(TorchBackend, "asarray", asarray)
        for name in READS:
            patch(torch.Tensor, name, read(name, getattr(torch.Tensor, name)))
        for name in MAKERS:
            patch(torch, name, make(name, getattr(torch, name)))
        for name in SIZED:
            patch(torch.Tensor, name, read(name, getattr(torch.Tensor, name), str(_PKG) + "/"))
            patch(torch, name, make(name, getattr(torch, name), str(_PKG) + "/"))
        yield found
    finally:
        for owner, name, old in reversed(saved):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def checks(backend) -> tuple[list[str], int]:
    """:data:`SPECS` through the kernels (``backend``: CPU tensors taking the device path, in
    Triton's interpreter): a first step (kernels compiled, state made, tables cached), then a
    recorded one; the specs whose second step copied or read anything, and the cases."""
    x = torch.randn(20_011, generator=torch.Generator().manual_seed(0))
    bad = []
    for spec in SPECS:
        comp = build(spec, backend)
        step(comp, x)
        with recording([]) as found:
            step(comp, x)
        if found:
            bad.append(f"{spec} waits for the device: {sorted(set(found))}")
    return bad, len(SPECS)
