"""Which Triton kernels run by default on CUDA devices: not those measured slower than the
torch chain they replace (``SLOWER_ON_CUDA`` of :mod:`hvd_compress.accel.triton_quantizers`, the radix
select from :data:`~hvd_compress.accel.device.SELECT_CHAIN_FROM` values), unless
``HVD_COMPRESS_TRITON=all``; the interpreter (the tests' CPU path) runs every kernel.
No triton needed: the kernels' module is a stand-in."""

from __future__ import annotations

import types

import pytest
import torch

from hvd_compress.accel import device
from hvd_compress.accel.registry import ByClass
from hvd_compress.core import build
from hvd_compress.core.variable import Inceptionn


class _Cuda:
    """A tensor-like on a CUDA device (only ``device`` and ``numel`` are read)."""
    device = torch.device("cuda", 0)

    def __init__(self, n=10):
        self.n = n

    def numel(self):
        return self.n


@pytest.fixture
def kernels(monkeypatch):
    fake = types.SimpleNamespace(ENCODERS=ByClass({Inceptionn: lambda B, o, c: "inceptionn enc",
                                                   type(build("qsgd").codec): lambda B, o, c: "qsgd enc"}),
                                 DECODERS=ByClass({Inceptionn: lambda B, o, c: "inceptionn dec"}),
                                 SLOWER_ON_CUDA=ByClass({Inceptionn: "measured slower"}),
                                 top_indices=lambda B, mag, k: "radix select")
    monkeypatch.setattr(device, "_kernels", lambda like: fake)
    monkeypatch.delenv("HVD_COMPRESS_TRITON", raising=False)
    return fake


def test_kernels_slower_than_their_chains_stay_off_on_cuda(kernels, monkeypatch):
    inc, qsgd = build("inceptionn"), build("qsgd").codec
    assert device.device_encoder(None, inc, 1, _Cuda()) is None
    assert device.device_decoder(None, inc, 1, _Cuda()) is None
    assert device.device_encoder(None, qsgd, 1, _Cuda()) == "qsgd enc"  # the others run
    big, small = _Cuda(device.SELECT_CHAIN_FROM), _Cuda(device.SELECT_CHAIN_FROM - 1)
    assert device.device_top_indices(None, big, 5) is None
    assert device.device_top_indices(None, small, 5) == "radix select"
    monkeypatch.setenv("HVD_COMPRESS_TRITON", "all")  # to time or test them
    assert device.device_encoder(None, inc, 1, _Cuda()) == "inceptionn enc"
    assert device.device_decoder(None, inc, 1, _Cuda()) == "inceptionn dec"
    assert device.device_top_indices(None, big, 5) == "radix select"
    monkeypatch.setenv("HVD_COMPRESS_TRITON", "0")
    assert device.enabled() is False


def test_the_interpreter_runs_every_kernel(kernels):
    """CPU tensors under Triton's interpreter (the tests' path): nothing held back."""
    inc, cpu = build("inceptionn"), torch.zeros(device.SELECT_CHAIN_FROM // 1024)
    assert device.device_encoder(None, inc, 1, cpu) == "inceptionn enc"
    assert device.device_decoder(None, inc, 1, cpu) == "inceptionn dec"
    assert device.device_top_indices(None, cpu, 5) == "radix select"
