"""PyTorch runs the reference core's algorithms bit for bit (CPU here; CUDA when present)."""

import zlib

import numpy as np
import pytest
import torch

from hvd_compress.core import NUMPY, build
from hvd_compress.torch import TorchBackend, compressor

T = TorchBackend()


class DevicePath(TorchBackend):
    """CPU tensors treated as device memory: runs the sync-free code path GPUs take."""

    def is_host(self, x):
        return False


BACKENDS = {"host": T, "device-path": DevicePath()}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))]
SPECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.003", "randomk:ratio=0.1",
         "randomk:ratio=0.1,unbiased=true", "dgc:ratio=0.01", "dgc:ratio=0.01,nesterov=true,clip_norm=1",
         "dgc:ratio=0.01,compress_1d=true,masking=false",
         "qsgd:levels=7", "qsgd:levels=16,bucket=64", "qsgd:levels=1", "terngrad", "terngrad:clip=0",
         "onebit", "threshold:tau=0.01", "topk:ratio=0.1+qsgd:levels=16", "randomk:ratio=0.1+fp16",
         "dgc:ratio=0.05+terngrad", "topk:ratio=0.2+onebit", "topk:ratio=0.2+bf16",
         "dgc:ratio=0.05+threshold:tau=0.1",
         "signsgd", "signum", "signsgd:vote=false", "efsignsgd", "natural", "uniform",
         "uniform:bits=3,bucket=64,stochastic=false", "uniform:bits=8,ef=true", "eightbit",
         "eightbit:ef=true", "topk:ratio=0.1+natural", "topk:ratio=0.2+efsignsgd",
         "randomk:ratio=0.1+uniform:bits=2", "dgc:ratio=0.05+eightbit", "sketchml",
         "sketchml:buckets=16,ef=true", "sketchml:buckets=300,sample=100",
         "topk:ratio=0.1+sketchml:buckets=8", "thresholdv:tau=0.01", "thresholdv:tau=0.1",
         "adaq", "adaq:ratio=0.3", "inceptionn", "inceptionn:bound=1e-5,ef=true"]
SHAPES = [(1,), (7,), (40, 30), (6, 3, 3, 3), (70001,)]


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.int16).tobytes() if a.dtype == np.uint16 else a.tobytes()


def _noise_len(comp, meta):
    return comp.k_for(meta) if comp.spec.composed else meta.numel


@pytest.mark.parametrize("path", list(BACKENDS))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_same_payload_bytes_and_decode_as_numpy(spec, shape, device, path):
    ref, tor = build(spec, NUMPY), build(spec, BACKENDS[path])
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape)).encode()))
    needs_noise = ref.draws_noise
    for step in range(3):  # several steps: residuals, DGC memory, step-keyed indices
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        meta = ref.meta_for(x, "w")
        noise = rng.random(_noise_len(ref, meta), dtype=np.float32) if needs_noise else None
        er = ref.encode(x, "w", noise=noise)
        et = tor.encode(torch.from_numpy(x).to(device), "w",
                        noise=None if noise is None else torch.from_numpy(noise).to(device))
        assert et.nbytes == er.nbytes
        assert _bytes(T.to_numpy(et.payload)) == _bytes(er.payload), (spec, shape, step)
        dr = ref.aggregate(er.payload if ref.summable else [er.payload], er)
        dt = tor.aggregate(et.payload if tor.summable else [et.payload], et)
        assert dt.device.type == device and dt.dtype == torch.float32
        np.testing.assert_array_equal(T.to_numpy(dt), dr)
    for key, value in ref.states.get("w", {}).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(T.to_numpy(tor.states["w"][key]), value, err_msg=key)


@pytest.mark.parametrize("device", DEVICES)
def test_powersgd_matches_numpy_to_rounding(device):
    ref, tor = build("powersgd:rank=2", NUMPY), build("powersgd:rank=2", T)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((40, 30)).astype(np.float32)
        er = ref.encode(x, "w")
        et = tor.encode(torch.from_numpy(x).to(device), "w")
        np.testing.assert_allclose(T.to_numpy(et.payload), er.payload, rtol=1e-4, atol=1e-5)
        er = ref.next_round(er, er.payload)
        et = tor.next_round(et, et.payload)
        dr = ref.aggregate(er.payload, er)
        dt = tor.aggregate(et.payload, et)
        np.testing.assert_allclose(T.to_numpy(dt), dr, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_amp_and_double_gradients_are_accepted(dtype):
    comp = compressor("topk:ratio=0.5").core
    x = torch.tensor([0.5, -2.0, 0.25, 1.0], dtype=dtype)
    enc = comp.encode(x, "g")
    out = comp.aggregate([enc.payload], enc)
    assert out.dtype == dtype
    assert out.tolist() == [0.0, -2.0, 0.0, 1.0]


def test_large_topk_uses_the_exact_k_largest():
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    comp = build("topk:ratio=0.01,ef=false", T)
    enc = comp.encode(x, "big")
    out = comp.aggregate([enc.payload], enc)
    k = 10001
    top = torch.topk(x.abs(), k).indices
    expect = torch.zeros_like(x)
    expect[top] = x[top]
    assert torch.equal(out, expect)


def test_kth_largest_fast_path_is_exact():
    from hvd_compress.core.backend import selection_sample
    from hvd_compress.torch.backend import _kth_largest_sampled
    g = torch.Generator().manual_seed(1)
    for n, k in [(100_000, 1), (100_000, 1000), (2_000_000, 20_000), (300_000, 4000)]:
        x = torch.rand(n, generator=g)
        x[:50] = 0.5  # ties
        plan = selection_sample(n, k)
        assert plan is not None  # these sizes take the sampled path
        assert _kth_largest_sampled(x, k, *plan) == torch.kthvalue(x, n - k + 1).values


@pytest.mark.parametrize("device", DEVICES)
def test_device_selection_primitives_match_numpy(device):
    """The device path's k-th largest (topk, not CUDA's one-block kthvalue) and compaction
    (a search of the running count) against numpy: ties, k = n, k past n/2, masks with
    fewer than k entries or none."""
    from hvd_compress.core import NUMPY
    B = BACKENDS["device-path"]
    rng = np.random.default_rng(3)
    for n, k in [(1, 1), (7, 3), (10, 10), (1000, 5), (1000, 999), (100_001, 37), (100_001, 60_000)]:
        x = rng.standard_normal(n).astype(np.float32)
        x[::3] = x[0]  # ties
        t = torch.from_numpy(x).to(device)
        for kk in sorted({1, k, n, max(1, n // 2), n // 2 + 1} - {0}):
            assert float(B.kth_largest(t, kk)) == float(np.sort(x)[n - kk]), (n, kk)
        for density in (0.0, 0.01, 0.5, 1.0):
            mask = rng.random(n) < density
            got = B.compact(torch.from_numpy(mask).to(device), k)
            assert got.dtype == torch.int64 and got.device == t.device
            assert np.array_equal(got.cpu().numpy(), NUMPY.compact(mask, k)), (n, k, density)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_with_transposes_and_the_residual_product(device):
    """The backend's products (PowerSGD's M Q, M^T P, P Q^T and M - P Q^T, every
    transpose combination) against float64 products, to float32 rounding; contiguous
    results (they are sent as they are)."""
    rng = np.random.default_rng(5)
    m, p, q = (rng.standard_normal(s).astype(np.float32) for s in ((300, 70), (300, 2), (70, 2)))
    t = {k: torch.from_numpy(v).to(device) for k, v in (("m", m), ("p", p), ("q", q))}
    m64, p64, q64 = m.astype(np.float64), p.astype(np.float64), q.astype(np.float64)
    cases = [(T.matmul(t["m"], t["q"]), m64 @ q64),
             (T.matmul(t["m"], t["p"], transpose_a=True), m64.T @ p64),
             (T.matmul(t["p"], t["q"], transpose_b=True), p64 @ q64.T),
             (T.matmul(t["q"], t["m"], transpose_a=True, transpose_b=True), q64.T @ m64.T),
             (T.subtract_product(t["m"], t["p"], t["q"]), m64 - p64 @ q64.T)]
    for got, want in cases:
        assert got.is_contiguous() and got.dtype == torch.float32
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


def test_noise_generator_state_round_trips():
    a = build("qsgd", T)
    x = torch.randn(1000)
    a.encode(x, "w")
    saved = a.state_dict()
    b = build("qsgd", T)
    b.load_state_dict(saved)
    pa, pb = a.encode(x, "w").payload, b.encode(x, "w").payload
    assert torch.equal(pa, pb)
    # saved again before its first draw (a checkpoint of a resumed run, the ranks' state
    # sync at the first exchange): the loaded state, not a fresh generator's
    c = build("qsgd", T)
    c.load_state_dict(saved)
    d = build("qsgd", T)
    d.load_state_dict(c.state_dict())
    assert torch.equal(d.encode(x, "w").payload, pa)


@pytest.mark.parametrize("spec", SPECS + ["powersgd:rank=1"])
def test_device_path_handles_non_finite_like_the_host_path(spec):
    for backend in (T, DevicePath()):
        comp = build(spec, backend)
        x = torch.randn(30, 20, generator=torch.Generator().manual_seed(0))
        _one_rank(comp, x)
        before = {k: v.clone() for k, v in comp.states.get("w", {}).items()
                  if isinstance(v, torch.Tensor)}
        bad = x.clone()
        bad[2, 3] = float("nan")
        out = _one_rank(comp, bad)
        assert not torch.isfinite(out).all()
        for key, value in before.items():
            if key != "q":
                assert torch.equal(comp.states["w"][key], value), (spec, key)
        assert torch.isfinite(_one_rank(comp, x)).all()


def _one_rank(comp, x):
    enc = comp.encode(x, "w")
    for _ in range(comp.rounds(enc.meta) - 1):
        enc = comp.next_round(enc, enc.payload)
    return comp.aggregate(enc.payload if comp.summable else [enc.payload], enc)
