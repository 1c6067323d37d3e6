"""Adding an algorithm with a fast path touches two files: its algorithm module and its
accelerator module.

The test writes a toy compressor (each value clipped to ``[-clip, clip]``, sent as its
float32 bytes; with error feedback the clipped-off part stays behind) and its numba host
fast path into a fresh package of exactly those two files, imports them -- nothing in
``hvd_compress`` names the toy -- and shows that the fast path runs and gives the
reference chain's bits: payloads, decoded values and residuals, over steps, a NaN step
included.
"""

import sys

import numpy as np
import pytest

from hvd_compress.accel import host
from hvd_compress.core import build
from hvd_compress.core.registry import unregister

pytestmark = pytest.mark.skipif(not host.numba_available(), reason="numba is not installed")

ALGORITHM = '''
"""Toy clip: each value clipped to [-clip, clip] (the chain of array operations)."""

from hvd_compress.core import Encoded
from hvd_compress.core.base import Compressor, PayloadFastPath
from hvd_compress.core.registry import Algorithm, Param, register


class ToyClip(PayloadFastPath, Compressor):
    """Each value clipped to ``[-clip, clip]``, sent as float32 bytes (a whole payload
    that an accelerator may make, :class:`PayloadFastPath`)."""

    name = "toyclip"

    def payload_nbytes(self, meta):
        return 4 * meta.numel

    def _encode(self, v, meta, st, noise, flag):
        B = self.B
        c = float(self.params["clip"])
        sent = B.where(B.abs(v) > c, B.sign(v) * c, v)
        if flag is not None:  # a non-finite step: the payload decodes to NaN
            sent = sent * flag
        return Encoded(B.bitcast(sent, "uint8"), meta, self.payload_nbytes(meta))

    def _decode(self, payload, meta, ctx):
        return self.B.bitcast(payload, "float32")


register(Algorithm("toyclip", "ToyClip", ToyClip,
                   params={"clip": Param(float, 0.01, None, "the bound"),
                           "ef": Param(bool, True, None, "error feedback")},
                   doc="Toy: values clipped to [-clip, clip] (tests only)."), replace=True)
'''

ACCELERATOR = '''
"""Toy clip's host fast path: one numba pass clips, and with error feedback leaves the
clipped-off part in the residual."""

import functools
import types

import numpy as np

from hvd_compress.accel.host import ef_encoder, register
from toyclip import ToyClip

CALLS = []  # one entry a fast step (what the test reads)


@functools.cache
def kernels():
    """Compiled on the first fast path asked for (numba is not imported before)."""
    from numba import njit

    @njit(nogil=True)
    def clip(v, c, out, subtract):
        for i in range(v.shape[0]):
            x = v[i]
            y = min(max(x, -c), c)
            out[i] = y
            if subtract:
                v[i] = x - y
    return types.SimpleNamespace(clip=clip)


def _clip(k, B, comp, v, noise, ef):
    CALLS.append(1)
    out = np.empty(B.shape(v)[0], np.float32)
    k.clip(B.host_view(v), np.float32(comp.params["clip"]), out, ef)
    return {"payload": B.from_host(out.view(np.uint8))}


register(ToyClip, encoder=ef_encoder(_clip), kernels=kernels)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's two files in a fresh package directory, imported; forgotten afterwards."""
    (tmp_path / "toyclip.py").write_text(ALGORITHM)
    (tmp_path / "toyclip_accel.py").write_text(ACCELERATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toyclip
    import toyclip_accel
    yield toyclip, toyclip_accel
    host.unregister(toyclip.ToyClip)
    unregister("toyclip")
    for name in ("toyclip", "toyclip_accel"):
        sys.modules.pop(name, None)


def _steps(spec, xs, fused, monkeypatch):
    """Each step's payload bytes, decoded sum and residual."""
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if fused else "0")
    comp = build(spec)
    out = []
    for x in xs:
        with np.errstate(invalid="ignore"):
            enc = comp.encode(x, "w")
            decoded = comp.aggregate([enc.payload], enc)
        out.append((np.asarray(enc.payload).tobytes(), np.asarray(decoded).tobytes(),
                    None if comp.states["w"].residual is None else comp.states["w"].residual.tobytes()))
    return out


@pytest.mark.parametrize("spec", ["toyclip", "toyclip:clip=0.005,ef=false"])
def test_a_new_algorithm_with_a_fast_path_is_two_files(spec, toy, monkeypatch):
    algorithm, accelerator = toy
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal(1000) * 1e-2).astype(np.float32) for _ in range(3)]
    xs.append(np.concatenate([[np.nan, -0.0, 0.0, 0.01, -0.01], xs[0][5:]]).astype(np.float32))
    xs.append(xs[1])
    comp = build(spec)
    assert type(comp) is algorithm.ToyClip
    assert host.PATHS.find(comp).cls is algorithm.ToyClip  # found by its class
    plain = _steps(spec, xs, False, monkeypatch)
    assert accelerator.CALLS == []
    fused = _steps(spec, xs, True, monkeypatch)
    assert len(accelerator.CALLS) == len(xs) - 1  # every finite step (the NaN one: the chain)
    assert fused == plain
    assert np.isnan(np.frombuffer(fused[3][1], np.float32)).any()  # the NaN step went the chain's way
    if "ef=false" not in spec:  # the clipped-off part stayed behind
        assert np.abs(np.frombuffer(plain[0][2], np.float32)).max() > 0
