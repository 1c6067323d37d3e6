"""The fused CPU kernels give the same bits as the reference chain of array operations."""

import zlib

import numpy as np
import pytest
import torch

from hvd_compress.accel import host, host_select, host_stochastic
from hvd_compress.core import NUMPY, build
from hvd_compress.core.quantizers import QSGDCodec, TernGradCodec, make_codec
from hvd_compress.torch import TorchBackend

pytestmark = pytest.mark.skipif(not host.numba_available(), reason="numba is not installed")
kernels = host.numba_kernels()  # hvd_compress.accel.kernels: what the fast paths call
SPECS = ["threshold:tau=0.01", "threshold:tau=0.01,ef=false", "onebit", "onebit:ef=false",
         "terngrad", "terngrad:clip=0", "terngrad:ef=true", "qsgd:levels=7",
         "qsgd:levels=16,bucket=64", "qsgd:levels=7,ef=true", "qsgd:levels=1,bucket=3",
         "qsgd:levels=127,bucket=5", "qsgd:levels=7,bucket=8000",
         "signsgd", "efsignsgd", "efsignsgd:ef=false", "natural", "natural:ef=true", "uniform",
         "uniform:bits=8,stochastic=false,ef=true", "uniform:bits=3,bucket=7",
         "uniform:bits=1,bucket=5,ef=true", "uniform:bits=2,bucket=64", "eightbit", "eightbit:ef=true",
         "sketchml", "sketchml:buckets=7,ef=true", "sketchml:buckets=300,sample=50", "signum",
         "signum:momentum=0.5,vote=false", "adaq", "adaq:ratio=0.3,ef=false", "adaq:ratio=1",
         "topk", "topk:ratio=0.3,ef=false",
         "inceptionn", "inceptionn:bound=1e-6", "inceptionn:bound=0.5"]
SHAPES = [(1,), (5,), (9,), (1001,), (300, 7), (70001,)]


def _needs_noise(comp):
    return getattr(getattr(comp, "codec", None), "needs_noise", False)


def _run(spec, backend, xs, noises, fused, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if fused else "0")
    monkeypatch.setattr(host, "SMALLEST", {})  # the kernels on small tensors too
    comp = build(spec, backend)
    payloads = []
    for x, noise in zip(xs, noises):
        if backend is not NUMPY:
            x, noise = torch.from_numpy(x), torch.from_numpy(noise)
        enc = comp.encode(x, "w", noise=noise if _needs_noise(comp) else None)
        payloads.append(np.asarray(backend.to_numpy(enc.payload)).tobytes())
        decoded = comp.aggregate([enc.payload], enc)  # the fused decoders too
        payloads.append(np.asarray(backend.to_numpy(decoded)).tobytes())
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


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["signsgd", "signum", "efsignsgd"])
def test_sign_kernels_on_zeros_and_signed_zeros(spec, backend, monkeypatch):
    """An all-zero step sends a scale of 0 (Signum: a zero momentum), -0.0 counts as +;
    the kernels agree with the chain on the payload, the decoded values and the state."""
    xs = [np.zeros(37, np.float32), np.full(37, -0.0, np.float32),
          np.array([-0.0, 0.0, 1e-30, -1e-30] * 9 + [2.0], np.float32)]
    noises = [np.zeros(37, np.float32)] * 3
    fused, plain = (_run(spec, backend, xs, noises, f, monkeypatch) for f in (True, False))
    assert fused[0] == plain[0]
    assert np.frombuffer(fused[0][0][:4], np.float32)[0] == 0.0  # the first step's scale
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["adaq", "adaq:ratio=0.2", "inceptionn:bound=0.01", "topk:ratio=0.1",
                                  "topk:ratio=0.9,ef=false", "inceptionn:bound=1e-310"])
@pytest.mark.parametrize("n", [3, 64, 5003, 70001])
def test_selection_and_width_kernels_on_ties_zeros_and_extremes(spec, n, backend, monkeypatch):
    """Many equal magnitudes (ties go to the lower index, across the kernels' stretches),
    zeros of both signs, one sign only, tiny and huge values: the fused adaq and
    INCEPTIONN payloads, decoded values and residuals are the chain's."""
    rng = np.random.default_rng(n)
    ties = (rng.integers(-3, 4, n) * 0.01).astype(np.float32)
    signed_zeros = np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)) + ties * 0
    positive = np.abs(ties) + np.float32(0.01)
    extremes = (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 38, n)).astype(np.float32)
    xs = [ties, signed_zeros.astype(np.float32), positive, extremes]
    noises = [np.zeros(n, np.float32)] * len(xs)
    fused, plain = (_run(spec, backend, xs, noises, f, monkeypatch) for f in (True, False))
    assert fused[0] == plain[0]
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["uniform:bucket=4", "uniform:bucket=4,stochastic=false,ef=true",
                                  "eightbit", "eightbit:ef=true"])
def test_level_kernels_on_extreme_ranges(spec, backend, monkeypatch):
    """Subnormal and wider-than-float32 ranges (the scales' clamps): the kernels' bits."""
    from tests.test_catalogue import EXTREMES
    xs = [np.array(v * 3, np.float32) for v in EXTREMES.values()]
    noises = [np.linspace(0, 0.99, 12, dtype=np.float32)] * len(xs)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        fused, plain = (_run(spec, backend, xs, noises, f, monkeypatch) for f in (True, False))
    assert fused[0] == plain[0]
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["dgc:ratio=0.01,warmup_epochs=0",
                                  "dgc:ratio=0.1,warmup_epochs=0,nesterov=true,masking=false",
                                  "dgc:ratio=0.001,warmup_epochs=2,steps_per_epoch=1",
                                  "dgc:ratio=0.01,warmup_epochs=0,sample_ratio=0.001"])
def test_dgc_kernels_match_the_chain(spec, backend, monkeypatch):
    """DGC's fused step on matrices over steps: normal values, zeros, ties, values
    packed in a few strata so that fewer than k pass the lowered threshold (every one
    that passes is sent, the rest of the slots empty), and a NaN step: the payloads,
    decoded sums and u, v are the chain's."""
    rng = np.random.default_rng(zlib.crc32(spec.encode()))
    shape = (1000, 70)
    normal = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    zeros = normal.copy()
    zeros.flat[::3] = 0.0
    ties = np.round(normal * 100).astype(np.float32) / 100
    packed = np.zeros(shape, np.float32)
    packed.flat[35000:35700] = rng.uniform(0.5, 1.5, 700).astype(np.float32)
    bad = normal.copy()
    bad[5, 5] = np.nan  # the fast path declines, untouched: the chain's non-finite step
    xs = [normal, zeros, ties, packed, np.zeros(shape, np.float32), bad, normal]
    noises = [np.zeros(1, np.float32)] * len(xs)
    with np.errstate(invalid="ignore"):
        fused, plain = (_run(spec, backend, xs, noises, f, monkeypatch) for f in (True, False))
    assert fused[0] == plain[0]
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)
    if spec == "dgc:ratio=0.01,warmup_epochs=0":  # the packed step sent fewer than k
        k = 700
        indices = np.frombuffer(fused[0][6][:4 * k], np.int32)
        assert 0 < np.count_nonzero(indices) < k


def test_dgc_gather_in_the_pass_and_its_fallbacks_match_the_chain(monkeypatch):
    """The momentum pass gathers the values at or above the sampled threshold while each
    block is in cache.  A first step on a 2**21-value matrix (16 stretches) of each
    kind takes each way out of it: spread values (the gather); the threshold lowered
    (2.0 at the three sampled positions that set it and nowhere else, 1,000 values of
    1.7: one more pass gathers at the lowering); 5,000 ties, far more than k but
    gathered and partitioned rather than counted by bit patterns.  Same bits as the
    chain, and each way taken as said."""
    n, spec = 1 << 21, "dgc:ratio=0.0001,warmup_epochs=0"
    rng = np.random.default_rng(7)
    spread = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    lowered = np.full(n, 1e-3, np.float32)
    comp = build(spec)
    pos, want = comp.sample_plan(comp.meta_for(lowered.reshape(2048, 1024), "w"), 0)
    assert want == 3
    lowered[rng.choice(n, 1000, replace=False)] = 1.7
    lowered[pos[[5, 500, 5000]]] = 2.0
    ties = np.full(n, 1e-3, np.float32)
    ties[rng.choice(n, 5000, replace=False)] = 1.5
    calls = []
    for name in ("at_least", "top_counts"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    for x, used in ((spread, []), (lowered, ["at_least"]), (ties, [])):
        xs, noises = [x.reshape(2048, 1024)], [np.zeros(1, np.float32)]
        calls.clear()
        fused, plain = (_run(spec, NUMPY, xs, noises, f, monkeypatch) for f in (True, False))
        assert fused[0] == plain[0]
        for key in plain[1]:
            np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)
        assert calls == used


def test_adaq_takes_the_chain_below_its_smallest_size(monkeypatch):
    """The counts' fixed cost does not pay on small tensors: the fast path declines
    them untouched (the chain runs) and takes large ones."""
    calls = []
    real = kernels.top_select
    monkeypatch.setattr(kernels, "top_select", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
    comp = build("adaq")
    comp.encode(np.ones(1000, np.float32), "small")
    assert calls == []
    comp.encode(np.ones(1 << 16, np.float32), "large")
    assert calls == [1]


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["onebit", "onebit:ef=false"])
@pytest.mark.parametrize("shape", [(2, 1), (1, 9), (9, 13), (40, 3, 3, 3), (513, 130), (3, 20001)])
def test_onebit_by_columns_matches_the_chain(spec, shape, backend, monkeypatch):
    """1-bit SGD by columns: each column summed down the rows in the reference's order
    (the float64 sums exactly), with columns of zeros and signed zeros, a column of
    one sign, blocks of columns split across threads, and rows not a multiple of 8;
    and the kernels are the ones that ran."""
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape)).encode()))
    xs = [(rng.standard_normal(shape) * rng.uniform(1e-4, 1e2, shape)).astype(np.float32)
          for _ in range(3)]
    cols = int(np.prod(shape[1:]))
    for x in xs:
        m = x.reshape(-1, cols)
        m[:, 0] = 0.0
        if cols > 2:
            m[::2, 1] = -0.0
            m[:, 2] = np.abs(m[:, 2])
    calls = []
    for name in ("column_sign_sums", "onebit_pack_columns", "bit_decode_columns"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    noises = [np.zeros(int(np.prod(shape)), np.float32)] * 3
    fused = _run(spec, backend, xs, noises, True, monkeypatch)
    plain = _run(spec, backend, xs, noises, False, monkeypatch)
    if cols > 1:
        assert set(calls) == {"column_sign_sums", "onebit_pack_columns", "bit_decode_columns"}
    assert fused[0] == plain[0]
    for key in plain[1]:
        np.testing.assert_array_equal(fused[1][key], plain[1][key], err_msg=key)
    # the float64 sums themselves, bit for bit (signs of zero included), on values spread
    # over 40 decades, whose float64 sums depend on the order of the additions
    m = xs[0].reshape(-1, cols) * (10.0 ** rng.uniform(-20, 20, (xs[0].size // cols, cols))
                                  ).astype(np.float32)
    npos, total, spos = np.empty(cols, np.int64), np.empty(cols), np.empty(cols)
    kernels.column_sign_sums(m, npos, total, spos)
    for got, want in ((npos, np.count_nonzero(m >= 0, axis=0)),
                      (total, np.sum(m, axis=0, dtype=np.float64)),
                      (spos, np.sum(np.maximum(m, 0.0), axis=0, dtype=np.float64))):
        assert got.tobytes() == want.astype(got.dtype).tobytes()


def test_the_fused_path_is_taken(monkeypatch):
    calls = []
    real = kernels.threshold_pack
    monkeypatch.setattr(kernels, "threshold_pack", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
    comp = build("threshold:tau=0.5")
    comp.encode(np.array([1.0, -1.0, 0.1], np.float32), "w")
    assert calls == [1]
    np.testing.assert_array_equal(comp.states["w"]["residual"], np.array([0.5, -0.5, 0.1], np.float32))
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    build("threshold:tau=0.5").encode(np.ones(3, np.float32), "w")
    assert calls == [1]


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
def test_the_hook_serves_host_memory_and_may_decline(backend, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
    for name in ("threshold", "onebit", "terngrad", "qsgd", "signsgd", "efsignsgd", "natural",
                 "uniform", "eightbit", "sketchml"):
        assert backend.fused_encoder(make_codec(name, {}), 1) is not None, name
    assert backend.fused_encoder(make_codec("signum", {"momentum": 0.9}), 1) is not None
    assert backend.fused_encoder(build("dgc", backend), 1) is not None
    for spec in ("adaq", "inceptionn", "topk"):  # whole payloads: the compressor as the "codec"
        assert backend.fused_encoder(build(spec, backend), 1) is not None, spec
    assert backend.fused_decoder(build("inceptionn", backend), 1) is not None
    assert backend.fused_encoder(build("inceptionn:ef=true", backend), 1) is None  # the chain
    assert backend.fused_encoder(build("thresholdv", backend), 1) is None
    assert backend.fused_encoder(build("topk+qsgd", backend), 1) is None
    for name in ("natural", "uniform", "eightbit", "sketchml", "signsgd", "efsignsgd"):
        assert backend.fused_decoder(make_codec(name, {}), 1) is not None, name
    assert backend.fused_decoder(make_codec("uniform", {"bits": 3}), 1) is None  # the chain
    assert backend.fused_decoder(make_codec("qsgd", {}), 1) is not None
    assert backend.fused_decoder(make_codec("terngrad", {}), 1) is not None
    assert backend.fused_decoder(make_codec("threshold", {}), 1) is not None
    assert backend.fused_decoder(make_codec("onebit", {}), 1) is not None
    assert backend.fused_decoder(make_codec("onebit", {}), 5) is not None  # by columns too
    assert backend.fused_decoder(make_codec("qsgd", {"levels": 16}), 1) is None  # 6 bits: the chain
    assert backend.fused_encoder(make_codec("onebit", {}), 5) is not None
    assert backend.fused_encoder(make_codec("fp16", {}), 1) is None
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    assert backend.fused_encoder(make_codec("qsgd", {}), 1) is None
    assert backend.fused_decoder(make_codec("natural", {}), 1) is None


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["threshold:tau=0.01", "onebit", "terngrad:ef=true", "qsgd:levels=7,ef=true",
                                  "qsgd:levels=16", "onebit:ef=false", "efsignsgd", "natural:ef=true",
                                  "uniform:ef=true", "eightbit:ef=true", "signsgd", "sketchml:ef=true",
                                  "signum", "adaq", "inceptionn", "topk", "topk:ef=false", "terngrad"])
@pytest.mark.parametrize("bad", ["nan", "inf", "overflow"])
def test_non_finite_steps_take_the_reference_path(spec, bad, backend, monkeypatch):
    """NaN/Inf in the gradient, or a float32 overflow of the error-feedback sum: the same
    payload and state with the fast path as without, and the step after agrees too."""
    rng = np.random.default_rng(zlib.crc32(repr((spec, bad)).encode()))
    xs = [(rng.standard_normal(1001) * 1e-2).astype(np.float32) for _ in range(3)]
    noises = [rng.random(1001, dtype=np.float32) for _ in range(3)]
    xs[1][7] = 3e38 if bad == "overflow" else float(bad)
    if bad == "overflow" and not build(spec).ef:
        pytest.skip("no error feedback: no sum to overflow")
    runs = []
    monkeypatch.setattr(host, "SMALLEST", {})  # the kernels on small tensors too
    for fused in (True, False):
        monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if fused else "0")
        comp = build(spec, backend)
        payloads = []
        for step, (x, noise) in enumerate(zip(xs, noises)):
            if step == 1 and bad == "overflow":  # a residual that the sum overflows
                comp.states["w"]["residual"][7] = 3e38
            if backend is not NUMPY:
                x, noise = torch.from_numpy(x), torch.from_numpy(noise)
            with np.errstate(over="ignore", invalid="ignore"):
                enc = comp.encode(x, "w", noise=noise if _needs_noise(comp) else None)
            payloads.append(np.asarray(backend.to_numpy(enc.payload)).tobytes())
            if step == 1:
                nan_step = np.asarray(backend.to_numpy(comp.aggregate([enc.payload], enc)))
                state = {k: np.array(backend.to_numpy(v)) for k, v in comp.states["w"].items()
                         if not isinstance(v, (int, float, dict))}
        runs.append((payloads, state))
    (fused_payloads, fused_state), (plain_payloads, plain_state) = runs
    assert fused_payloads == plain_payloads
    for key in plain_state:
        np.testing.assert_array_equal(fused_state[key], plain_state[key], err_msg=key)
    assert np.isnan(nan_step).any()  # the bad step went the non-finite way


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
def test_topk_steps_with_a_sampled_cut_match_the_chain(backend, monkeypatch):
    """Top-k with error feedback where a sampled cut runs (k in the thousands): the two
    passes over ``residual + g`` (``ef_count``, then ``ef_add_gather``) on normal steps,
    and the other ways on a sparse first step (the cut at 0: far more than k pass), a
    NaN step (nothing touched) and an overflow of the sum (added and undone): payloads,
    decoded values and the residual are the chain's after every step."""
    n = 300_000  # k = 3,000 at 1%
    rng = np.random.default_rng(11)
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, 1000, replace=False)] = rng.standard_normal(1000)
    xs = [sparse] + [(rng.standard_normal(n) * 1e-2).astype(np.float32) for _ in range(5)]
    xs[3][5] = np.nan
    xs[5][7] = 3e38
    gathers = []
    watched = kernels.ef_add_gather
    monkeypatch.setattr(kernels, "ef_add_gather", lambda *a: gathers.append(1) or watched(*a))
    runs = []
    for fused in (True, False):
        monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if fused else "0")
        comp, seen = build("topk:ratio=0.01", backend), []
        for step, x in enumerate(xs):
            if step == 5:  # a residual that the sum overflows
                comp.states["w"]["residual"][7] = 3e38
            with np.errstate(over="ignore", invalid="ignore"):
                enc = comp.encode(x if backend is NUMPY else torch.from_numpy(x), "w")
                out = comp.aggregate([enc.payload], enc)
            seen += [np.asarray(backend.to_numpy(v)).tobytes()
                     for v in (enc.payload, out, comp.states["w"]["residual"])]
        runs.append(seen)
    assert runs[0] == runs[1]
    assert len(gathers) == 3  # steps 1, 2 and 4 took the two passes


@pytest.mark.parametrize("scale", [1.0, 0.37, 1e-30])
def test_start_table_counts_exactly_like_a_binary_search(scale):
    """The 16-bit prefix table the 8-bit and SketchML kernels count on from gives the
    binary search's count for values at, just above and just below every edge, with
    ties among the edges, over float32's whole range and both signs."""
    from hvd_compress.accel.host_levels import start_table
    rng = np.random.default_rng(3)
    edges = np.sort((rng.standard_normal(300) * 10.0 ** rng.uniform(-3, 3, 300)).astype(np.float32))
    edges[10:20] = edges[10]
    near = edges / np.float32(scale)
    x = np.concatenate([near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, -np.float32(np.inf)),
                        (rng.standard_normal(20000) * 10.0 ** rng.uniform(-40, 38, 20000)).astype(np.float32),
                        np.array([0.0, -0.0, 3e38, -3e38], np.float32)]).astype(np.float32)
    x = x[np.isfinite(x)]
    codes = np.empty(x.size, np.uint8 if edges.size < 256 else np.uint16)
    if scale == 1.0:
        kernels.bucket_codes(x, edges, start_table(edges), codes, edges.size + 1, 64)
        np.testing.assert_array_equal(codes, np.searchsorted(edges, x, side="right"))
    table = np.zeros(edges.size + 1, np.float32)
    out = np.empty(x.size, np.uint16)
    inv = np.float32(scale)
    kernels.eightbit_codes(x.copy(), inv, edges, start_table(edges, inv), table, np.float32(1), out, False)
    np.testing.assert_array_equal(out, np.searchsorted(edges, x * inv, side="right"))


# -- hashed noise (noise not given: TernGrad and QSGD) --------------------------------------
def _model_uniform(n, key):
    """An independent model of the hashed noise, written from its definition in
    ``tensorflow/fused/quantize_ops.cc``: murmur3's finaliser twice over the index under
    the key, 24 bits, in uint32 arithmetic."""
    def fmix(h):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))
    i = np.arange(n, dtype=np.uint64)
    k0, k1 = np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)
    with np.errstate(over="ignore"):
        high = (i >> np.uint64(32)).astype(np.uint32)
        h = fmix(fmix(i.astype(np.uint32) * np.uint32(0x9E3779B1) + k0) ^ k1 ^ high)
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


class _Key:
    """A noise source that hands out one fixed key and counts how often it was asked."""

    def __init__(self, key):
        self.value, self.asked = key, 0

    def key(self, like=None):
        self.asked += 1
        return self.value


@pytest.mark.parametrize("spec", ["qsgd:levels=7", "qsgd:levels=16,bucket=64", "terngrad", "terngrad:clip=0"])
def test_hashed_noise_is_the_defined_hash(spec):
    """With a key, the kernels' codes are the codes of the given noise that the model of the
    hash draws -- and, where TensorFlow's ops are built, the ops' codes for the same key."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(70001) * 1e-2).astype(np.float32)
    key = 0xDEADBEEF12345678
    codec = build(spec).codec
    fields_of = {QSGDCodec: host_stochastic._qsgd, TernGradCodec: host_stochastic._terngrad}[type(codec)]
    hashed = fields_of(kernels, NUMPY, codec, x, None, _Key(key))
    given = fields_of(kernels, NUMPY, codec, x, _model_uniform(x.size, key), None)
    for name in hashed:
        np.testing.assert_array_equal(hashed[name], given[name])
    try:
        import tensorflow as tf

        from hvd_compress.tensorflow import fused_ops
        lib = fused_ops.library()
    except ImportError:
        lib = None
    if lib is None:
        return
    empty, k = tf.zeros([0], tf.float32), tf.constant([np.uint64(key).view(np.int64)], tf.int64)
    if codec.name == "qsgd":
        got = lib.hvdc_qsgd_encode(tf.constant(x), empty, empty, k, levels=codec.s, bucket=codec.d)
        names = ("norms", "codes")
    else:
        got = lib.hvdc_tern_grad_encode(tf.constant(x), empty, empty, k, clip=codec.clip)
        names = ("scale", "codes")
    for name, t in zip(names, got):
        np.testing.assert_array_equal(np.asarray(hashed[name]).ravel(), t.numpy().ravel())


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("spec", ["qsgd:levels=3", "terngrad", "qsgd:levels=7,ef=true"])
def test_hashed_noise_keeps_quantizers_unbiased_and_fresh(spec, backend):
    """Noise drawn by hash: a new key each step (payloads differ), the same for the same
    seed, and the decoded mean over 400 steps is the (clipped) input: unbiased."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(4000) * 1e-2).astype(np.float32)
    xt = x if backend is NUMPY else torch.from_numpy(x)
    comp, twin = build(spec, backend), build(spec, backend)
    steps, total, first = 400, np.zeros(x.size), []
    ef = "ef=true" in spec
    for step in range(steps):
        before = np.array(backend.to_numpy(comp.states["w"]["residual"]), np.float64) \
            if ef and step else 0.0
        enc = comp.encode(xt, "w")
        if step < 2:
            first.append(np.asarray(backend.to_numpy(enc.payload)).tobytes())
            assert np.asarray(backend.to_numpy(twin.encode(xt, "w").payload)).tobytes() == first[-1]
        decoded = np.asarray(backend.to_numpy(comp.aggregate([enc.payload], enc)), np.float64)
        total += decoded
        if ef:  # error feedback: what was not sent stays in the residual (float32 rounding)
            after = np.asarray(backend.to_numpy(comp.states["w"]["residual"]), np.float64)
            v = before + x
            np.testing.assert_allclose(decoded + after, v, rtol=0, atol=1e-6 * np.abs(v).max())
    assert first[0] != first[1]
    if ef:
        return
    target = np.clip(x, -2.5 * x.std(), 2.5 * x.std()) if spec == "terngrad" else x  # TernGrad clips
    err = total / steps - target
    assert abs(err.mean()) < 3 * err.std() / np.sqrt(x.size)
    assert np.abs(err).max() < 0.5 * np.abs(x).max()


@pytest.mark.parametrize("spec", ["qsgd:levels=7", "terngrad", "qsgd:levels=7,ef=true"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_hashed_noise_non_finite_draws_no_key(spec, bad, monkeypatch):
    """A NaN/Inf gradient: the kernels ask for no key (the generator is untouched) and the
    core's non-finite step runs, as without the fast path."""
    x = np.linspace(-1, 1, 70001, dtype=np.float32)
    x[123] = bad
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("HVD_COMPRESS_FUSED", fused)
        comp = build(spec)
        before = comp.noise.state()
        enc = comp.encode(x, "w")
        outs.append((np.asarray(enc.payload).tobytes(), comp.noise.state() == before))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("backend", [NUMPY, TorchBackend()], ids=["numpy", "torch"])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (1000, 1000), (70001, 701), (25_557_032, 2000),
                                 (1_000_003, 9_001), (20_480_000, 204_800)])
def test_stratified_kernel_gives_the_chains_indices(n, k, backend, monkeypatch):
    """random-k's indices and DGC's sample positions from the kernel are the chain's."""
    from hvd_compress.core.sampling import stratified_indices, stream_keys
    like = np.zeros(1, np.float32) if backend is NUMPY else torch.zeros(1)
    got = []
    for fused in ("1", "0"):
        monkeypatch.setenv("HVD_COMPRESS_FUSED", fused)
        key0, key1 = stream_keys(backend, 7, f"w{n}", 3, 1, like=like)
        got.append([np.asarray(backend.to_numpy(a)) for a in stratified_indices(backend, n, k, key0, key1,
                                                                                 like=like)])
    for fast, chain in zip(*got):
        assert fast.dtype == chain.dtype == np.int64
        np.testing.assert_array_equal(fast, chain)


def test_prime_stride():
    from hvd_compress.core.backend import prime_stride
    assert [prime_stride(s) for s in (1, 2, 3, 4, 9, 1024, 16384)] == [1, 2, 3, 5, 11, 1031, 16411]


def test_top_k_cut_is_not_fooled_by_a_matrix_whose_rows_divide_the_stride():
    """The main job's classifier gradient (rows of 256 columns, each column about
    constant down the rows) sampled every 1,024th value showed one column only, and the
    cut let a third of k through on one rank (every step then took the slower
    bit-pattern selection).  The same here with rows of 64 and a stride of 64: the
    prime stride samples every column, and at least k, about 1.2 k, pass."""
    rows, cols, kk = 20_000, 64, 12_800
    n = rows * cols
    rng = np.random.default_rng(0)
    column = rng.standard_normal(cols).astype(np.float32)
    g = (column[None, :] * (1 + 0.01 * rng.standard_normal((rows, cols)))).astype(np.float32)
    g = g.reshape(-1)
    raw = n // -(-host_select._SAMPLE_HITS * n // kk)
    assert raw % cols == 0  # the old stride: one column

    def passed(t):
        return int(np.count_nonzero(np.abs(g) >= t))

    sample = np.sort(np.abs(g[::raw]))  # the old cut, as _sample_cut read it
    e = kk * sample.size / n
    old = sample[sample.size - min(sample.size, int(e + 3 * np.sqrt(e)) + 1)]
    assert not kk <= passed(old) <= 8 * kk  # (why the fix: outside the fast path's range)
    assert kk <= passed(host_select._sample_cut(g, None, kk)) <= 2 * kk


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_decoded_results_reuse_a_buffer_only_once_nobody_holds_it(backend, monkeypatch):
    """A big decode's result buffer is reused for a later decode only after every array,
    view and tensor over it is gone: a result still held is never overwritten, the
    values are the reference chain's, and a dropped result's buffer comes back."""
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
    monkeypatch.setattr(host, "RESULTS", host._ResultBuffers())
    B = NUMPY if backend == "numpy" else TorchBackend()
    n = 300_000  # 1.2 MB: above the smallest buffer kept
    rng = np.random.default_rng(8)
    xs = [(rng.standard_normal((600, 500)) * 1e-3).astype(np.float32) for _ in range(4)]
    half = np.full(n, 0.5, np.float32)
    comp, ref = build("qsgd:levels=7", B), build("qsgd:levels=7", NUMPY)

    def step(x):
        enc = comp.encode(x if B is NUMPY else torch.from_numpy(x), "w",
                          noise=half if B is NUMPY else torch.from_numpy(half))
        got = comp.aggregate([enc.payload], enc)
        monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")  # the reference chain (no buffers taken)
        want = ref.aggregate([ref.encode(x, "w", noise=half).payload], enc)
        monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")
        np.testing.assert_array_equal(B.to_numpy(got), want)
        return got

    def where(r):
        return B.host_view(r).__array_interface__["data"][0]

    r0 = step(xs[0])
    held = np.array(B.to_numpy(r0), copy=True).reshape(-1)
    view = r0.reshape(-1)[10:]  # a view keeps the buffer too
    del r0
    r1 = step(xs[1])
    np.testing.assert_array_equal(B.to_numpy(view), held[10:])  # not overwritten
    assert where(r1) != where(view)
    freed = where(r1)
    del r1
    r2 = step(xs[2])
    assert where(r2) == freed  # the dropped result's buffer, reused
    del view
    r3 = step(xs[3])
    assert where(r3) != where(r2)  # r2 still held: another buffer
    assert len(host.RESULTS._kept) == 2
    small = host.RESULTS.take(1000)  # small results are always fresh, never kept
    assert small.shape == (1000,) and len(host.RESULTS._kept) == 2
