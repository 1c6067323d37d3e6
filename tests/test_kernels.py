"""The fused CPU kernels give the same bits as the reference chain of array operations."""

import zlib

import numpy as np
import pytest
import torch

from hvd_compress import kernels
from hvd_compress.core import NUMPY, build
from hvd_compress.torch import TorchBackend

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")
SPECS = ["threshold:tau=0.01", "threshold:tau=0.01,ef=false", "onebit", "onebit:ef=false",
         "terngrad", "terngrad:clip=0", "terngrad:ef=true", "qsgd:levels=7",
         "qsgd:levels=16,bucket=64", "qsgd:levels=7,ef=true", "qsgd:levels=1,bucket=3"]
SHAPES = [(1,), (5,), (9,), (1001,), (300, 7), (70001,)]


def _run(spec, backend, xs, noises, fused, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if fused else "0")
    comp = build(spec, backend)
    payloads = []
    for x, noise in zip(xs, noises):
        if backend is not NUMPY:
            x, noise = torch.from_numpy(x), torch.from_numpy(noise)
        enc = comp.encode(x, "w", noise=noise if comp.codec.needs_noise else None)
        payloads.append(np.asarray(backend.to_numpy(enc.payload)).tobytes())
    state = {k: np.asarray(backend.to_numpy(v)) for k, v in comp.states["w"].items()
             if not isinstance(v, (int, float, dict))}
    return payloads, state


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernels_match_the_reference_chain(spec, shape, backend, monkeypatch):
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape)).encode()))
    xs = [(rng.standard_normal(shape) * 1e-2).astype(np.float32) for _ in range(3)]
    noises = [rng.random(int(np.prod(shape)), dtype=np.float32) for _ in range(3)]
    fused = _run(spec, backend, xs, noises, True, monkeypatch)
    plain = _run(spec, backend, xs, noises, False, monkeypatch)
    assert fused[0] == plain[0]
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)


def test_the_fused_path_is_taken(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
    comp = build("threshold:tau=0.5")
    enc = comp.encode(np.array([1.0, -1.0, 0.1], np.float32), "w")
    assert enc.ctx["subtracted"] is True
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    assert build("threshold:tau=0.5").encode(np.ones(3, np.float32), "w").ctx["subtracted"] is False
