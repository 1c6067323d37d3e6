"""The fused TensorFlow CPU ops of the quantizers and sparsifiers (hvd_compress/tensorflow/fused/).

They must build here (scripts/setup.sh installs the compiler), give the numpy
reference's payload bytes, residuals and decoded values, keep the rules for
non-finite input, and their hashed noise must be uniform, reproducible and
independent of the number of threads.
"""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from hvd_compress.core import NUMPY, NumpyBackend, build  # noqa: E402
from hvd_compress.core.dgc import DGC  # noqa: E402
from hvd_compress.core.quantizers import make_codec  # noqa: E402
from hvd_compress.tensorflow import TensorFlowBackend, fused_ops  # noqa: E402
from tests.harness import THREAD_DIGESTS  # noqa: E402
from tests.test_torch_same_bits import _bytes  # noqa: E402

TFB = TensorFlowBackend()
NUMPY_TF = NumpyBackend(TFB.layout)  # the numpy reference in TensorFlow's layout (core.layout)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# qsgd levels 1, 2, 7, 10, 127: codes of 2, 3, 4, 5 and 8 bits
SPECS = ["threshold:tau=0.005", "threshold:tau=0.005,ef=0", "onebit", "onebit:ef=0", "terngrad",
         "terngrad:clip=0", "terngrad:ef=1", "qsgd:levels=1", "qsgd:levels=2,bucket=100", "qsgd",
         "qsgd:levels=10,bucket=333", "qsgd:levels=127,bucket=65536", "qsgd:levels=7,ef=1"]
# across 8-element bytes, 1024-element chunks and 65536-element blocks
SIZES = [1, 7, 9, 1000, 65536 * 2 + 13]


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")


def test_the_library_builds_and_loads():
    assert fused_ops.library() is not None, fused_ops.error()
    assert fused_ops.library_path().exists()


@pytest.mark.parametrize("name", ["threshold", "onebit", "terngrad", "qsgd"])
def test_the_fused_path_is_taken_where_it_applies(name, monkeypatch):
    codec = make_codec(name, {})
    assert TFB.fused_encoder(codec, 1) is not None
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    assert TFB.fused_encoder(codec, 1) is None
    assert NUMPY.fused_encoder(codec, 1) is None  # numpy's (numba kernels): the same switch


def test_other_codecs_take_the_chain():
    assert TFB.fused_encoder(make_codec("onebit", {}), 5) is not None  # by columns too
    assert TFB.fused_encoder(make_codec("fp16", {}), 1) is None


def _step(ref, tfc, x, noise):
    er = ref.encode(x, "w", noise=noise)
    et = tfc.encode(tf.constant(x), "w", noise=None if noise is None else tf.constant(noise))
    return er, et


def _assert_steps_match_numpy(spec, shape, steps=3):
    """Payload bytes, the residual left behind and the decoded tensor, step after step."""
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    rng = np.random.default_rng(zlib.crc32(f"{spec}{shape}".encode()))
    for step in range(steps):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        noise = rng.random(x.size, dtype=np.float32) if ref.codec.needs_noise else None
        er, et = _step(ref, tfc, x, noise)
        assert _bytes(et.payload.numpy()) == _bytes(er.payload), (spec, shape, step)
        if ref.ef:
            np.testing.assert_array_equal(tfc.states["w"]["residual"].numpy(), ref.states["w"]["residual"])
        np.testing.assert_array_equal(tfc.aggregate([et.payload], et).numpy(),
                                      ref.aggregate([er.payload], er))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("spec", SPECS)
def test_same_bits_as_numpy(spec, size):
    _assert_steps_match_numpy(spec, (size,))


@pytest.mark.parametrize("shape", [(40, 30), (6, 3, 3, 3), (3, 3, 64, 64), (1000, 7), (2, 65541), (70001, 1)])
@pytest.mark.parametrize("spec", ["onebit", "onebit:ef=0"])
def test_onebit_by_columns_same_bits_as_numpy(spec, shape):
    """1-bit SGD's column means of the out x in matrix a tensor makes (in TensorFlow's
    layout its last dimension is out): few rows and many columns, many rows and few, across
    blocks."""
    _assert_steps_match_numpy(spec, shape)


@pytest.mark.parametrize("spec", ["threshold:tau=0.005", "onebit", "terngrad:ef=1", "qsgd:ef=1"])
def test_same_bits_traced_with_variable_state(spec):
    from hvd_compress.tensorflow import compressor
    comp, ref = compressor(spec), build(spec, NUMPY_TF)
    needs_noise = ref.codec.needs_noise

    @tf.function
    def step(x, noise):
        enc = comp.encode(x, "w", noise=noise if needs_noise else None)
        return enc.payload, comp.aggregate([enc.payload], enc)

    rng = np.random.default_rng(3)
    for _ in range(3):
        x = (rng.standard_normal(70_001) * 1e-2).astype(np.float32)
        noise = rng.random(70_001, dtype=np.float32)
        er = ref.encode(x, "w", noise=noise if needs_noise else None)
        payload, dense = step(tf.constant(x), tf.constant(noise))
        assert _bytes(payload.numpy()) == _bytes(er.payload)
        np.testing.assert_array_equal(dense.numpy(), ref.aggregate([er.payload], er))
        np.testing.assert_array_equal(comp.tensor_state["w"]["residual"].numpy(), ref.states["w"]["residual"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("spec", ["threshold:tau=0.005", "onebit", "terngrad:ef=1", "qsgd:ef=1"])
def test_non_finite_input(spec, bad):
    """The payload is the reference's (codes of the cleaned values, NaN scales), the
    aggregate is NaN throughout and the residual stays as it was."""
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    rng = np.random.default_rng(1)
    n = 65536 + 100
    x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    noise = rng.random(n, dtype=np.float32) if ref.codec.needs_noise else None
    _step(ref, tfc, x, noise)  # a residual to keep
    before = tfc.states["w"]["residual"].numpy()
    y = x.copy()
    y[65536 + 7] = bad  # in the second block
    er, et = _step(ref, tfc, y, noise)
    assert _bytes(et.payload.numpy()) == _bytes(er.payload)
    assert np.isnan(tfc.aggregate([et.payload], et).numpy()).all()
    np.testing.assert_array_equal(tfc.states["w"]["residual"].numpy(), before)


def test_overflow_of_the_error_feedback_sum_is_non_finite():
    """A finite gradient whose sum with the residual overflows float32 is a non-finite step."""
    ref, tfc = build("onebit", NUMPY_TF), build("onebit", TFB)
    x = np.array([3e38, 1e38], np.float32)  # pos = 2e38: the residual keeps +-1e38
    _step(ref, tfc, x, None)
    before = tfc.states["w"]["residual"].numpy()
    np.testing.assert_array_equal(before, ref.states["w"]["residual"])
    assert np.abs(before).max() > 5e37
    er, et = _step(ref, tfc, x, None)  # 3e38 + 1e38 overflows
    assert _bytes(et.payload.numpy()) == _bytes(er.payload)
    assert np.isnan(tfc.aggregate([et.payload], et).numpy()).all()
    np.testing.assert_array_equal(tfc.states["w"]["residual"].numpy(), before)


def test_decode_op_same_bits_for_every_width():
    from hvd_compress.core.bitpack import pack_codes, unpack_values
    rng = np.random.default_rng(2)
    for bits in range(1, 9):
        for n in (1, 9, 1000, 70_001):
            codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
            data = pack_codes(NUMPY, codes, bits)
            table = (rng.standard_normal(1 << bits)).astype(np.float32).tolist()
            factors = rng.random(-(-n // 100)).astype(np.float32)
            want = unpack_values(NUMPY, data, bits, n, table, factors=factors, d=100)
            got = unpack_values(TFB, tf.constant(data), bits, n, table, factors=tf.constant(factors), d=100)
            np.testing.assert_array_equal(got.numpy(), want)
            np.testing.assert_array_equal(unpack_values(TFB, tf.constant(data), bits, n, table).numpy(),
                                          unpack_values(NUMPY, data, bits, n, table))


# -- hashed noise (noise=None) -----------------------------------------------------------
def test_hashed_noise_is_reproducible_and_fresh_each_step():
    x = tf.constant(np.linspace(-1, 1, 5000, dtype=np.float32))
    a, b = build("terngrad:clip=0,seed=3", TFB), build("terngrad:clip=0,seed=3", TFB)
    pa = [a.encode(x, "w").payload.numpy() for _ in range(3)]
    pb = [b.encode(x, "w").payload.numpy() for _ in range(3)]
    for u, v in zip(pa, pb):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(pa[0], pa[1])
    other = build("terngrad:clip=0,seed=4", TFB).encode(x, "w").payload.numpy()
    assert not np.array_equal(other, pa[0])


def test_hashed_noise_is_calibrated():
    """TernGrad keeps value v (clip off, scale 1) with probability |v|: across 200k values
    at ten levels, each level's kept fraction is within 4 standard errors of it."""
    levels = np.arange(10, dtype=np.float32) / 10 + 0.05
    x = np.repeat(levels, 20_000)
    x[0] = 1.0  # scale = max|x| = 1
    comp = build("terngrad:clip=0", TFB)
    enc = comp.encode(tf.constant(x), "w")
    kept = comp.aggregate([enc.payload], enc).numpy() != 0
    for i, p in enumerate(levels):
        frac = kept[i * 20_000 + 1:(i + 1) * 20_000].mean()
        assert abs(frac - p) < 4 * np.sqrt(p * (1 - p) / 20_000), (p, frac)


@pytest.mark.parametrize("spec", ["qsgd:levels=3", "terngrad"])
def test_hashed_noise_keeps_quantizers_unbiased(spec):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(4000) * 1e-2).astype(np.float32)
    comp = build(spec, TFB)
    steps = 400
    total = np.zeros_like(x, dtype=np.float64)
    for _ in range(steps):
        enc = comp.encode(tf.constant(x), "w")
        total += comp.aggregate([enc.payload], enc).numpy()
    target = np.clip(x, -2.5 * x.std(), 2.5 * x.std()) if spec == "terngrad" else x  # TernGrad clips
    err = total / steps - target
    # the mean error over 4000 values of a zero-mean estimate: far below one value's spread
    assert abs(err.mean()) < 3 * err.std() / np.sqrt(x.size)
    assert np.abs(err).max() < 0.5 * np.abs(x).max()


CODECS_BY_THREADS = """
import os, sys, numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
from hvd_compress.core import build
from hvd_compress.tensorflow import TensorFlowBackend
x = tf.constant((np.random.default_rng(0).standard_normal(300_001) * 1e-2).astype(np.float32))
out = []
for spec in ['onebit', 'terngrad', 'qsgd']:
    c = build(spec, TensorFlowBackend())
    out.append(c.encode(x, 'w').payload.numpy().tobytes())
m = tf.reshape(x[:300_000], [300, 1000])  # 1-bit SGD by columns
out.append(build('onebit', TensorFlowBackend()).encode(m, 'm').payload.numpy().tobytes())
import hashlib; print(hashlib.sha256(b''.join(out)).hexdigest())
"""
THREAD_DIGESTS.add("fused-codecs", CODECS_BY_THREADS)


def test_results_do_not_depend_on_the_number_of_threads():
    """The same payload with one intra-op thread (a fresh process) as with the default."""
    digests = THREAD_DIGESTS.digests("fused-codecs")
    assert len(digests[0]) == 64 and digests[0] == digests[1]


def test_cli_builds_and_reports_the_path():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    # --help beside the build (each process imports TensorFlow: a core each)
    helping = subprocess.Popen([sys.executable, "-m", "hvd_compress.tensorflow.fused_ops", "--help"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=env)
    out = subprocess.run([sys.executable, "-m", "hvd_compress.tensorflow.fused_ops"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    helped, _ = helping.communicate(timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(fused_ops.library_path()) in out.stdout
    assert helping.returncode == 0 and "usage" in helped


# -- the sparsifiers (hvd_compress/tensorflow/fused/sparse_ops.cc) ------------------------
def _sparse_data(kind, n, rng):
    """Gradients that reach every branch of the selection: normal values; many ties at
    the cut, spread over the stretches (collected candidates); a sparse gradient with
    fewer nonzeros than k (the boundary is the zeros' pattern, too many to collect:
    the stretches are scanned); values of a few levels (ties, scanned); all zeros; a
    guess at the cut from a strided sample that falls short (every value counted)."""
    x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    if kind == "ties":
        x[rng.choice(n, min(n, 997), replace=False)] = np.float32(0.5) * np.sign(x[:min(n, 997)] + 1e-9)
    elif kind == "sparse":
        x[rng.random(n) < 0.97] = 0.0
    elif kind == "levels":
        x = (rng.integers(-3, 4, n) * 0.25).astype(np.float32)
    elif kind == "zeros":
        x = np.zeros(n, np.float32)
    elif kind == "sampled":  # the ops' strided guess sees only large values: it falls short
        x[::max(1, n // 16384)] *= 100
    return x


def _reference(ref, x, name, monkeypatch, **kw):
    """The numpy reference's step: the chain of array operations (no numba kernels)."""
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    try:
        return ref.encode(x, name, **kw)
    finally:
        monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")


def _spy(monkeypatch, cls):
    calls = []
    real = fused_ops.ENCODERS[cls]
    monkeypatch.setitem(fused_ops.ENCODERS, cls,
                        lambda lib, comp, cols: calls.append(1) or real(lib, comp, cols))
    return calls


def _assert_sparse_steps(spec, xs, monkeypatch, shape=None, state=("residual",)):
    """Payload bytes, the state left behind and the decoded sum, step after step, against
    the numpy reference; the fused op ran every step."""
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    calls = _spy(monkeypatch, type(ref))
    for step, x in enumerate(xs):
        x = x.reshape(shape or x.shape)
        with np.errstate(invalid="ignore", over="ignore"):
            er = _reference(ref, x, "w", monkeypatch)
            et = tfc.encode(tf.constant(x), "w")
            assert _bytes(et.payload.numpy()) == _bytes(er.payload), (spec, step)
            for key in state:
                if key in ref.states["w"]:
                    np.testing.assert_array_equal(tfc.states["w"][key].numpy(), ref.states["w"][key],
                                                  err_msg=f"{spec} {key} step {step}")
            received = et.payload if tfc.summable else [et.payload]
            want = ref.aggregate(er.payload if ref.summable else [er.payload], er)
            np.testing.assert_array_equal(tfc.aggregate(received, et).numpy(), want)
    assert len(calls) == len(xs)
    return ref, tfc


TOPK_SPECS = ["topk:ratio=0.01", "topk:ratio=0.01,ef=false", "topk:ratio=0.1,ef=false", "topk:ratio=1",
              "topk:ratio=0.3"]


@pytest.mark.parametrize("size", [1, 7, 1000, 65536 * 2 + 13, 300_001])
@pytest.mark.parametrize("spec", TOPK_SPECS)
def test_topk_same_bits_as_numpy(spec, size, monkeypatch):
    rng = np.random.default_rng(zlib.crc32(f"{spec}{size}".encode()))
    kinds = ["normal", "ties", "sparse", "normal", "levels", "zeros", "sampled", "normal"]
    _assert_sparse_steps(spec, [_sparse_data(kind, size, rng) for kind in kinds], monkeypatch)


DGC_SPECS = ["dgc:ratio=0.01,warmup_epochs=0", "dgc:ratio=0.1,warmup_epochs=0,nesterov=true,masking=false",
             "dgc:ratio=0.001,warmup_epochs=3", "dgc:ratio=0.01,warmup_epochs=0,sample_ratio=0.001",
             "dgc:ratio=0.05,warmup_epochs=0,nesterov=true"]


def _dgc_data(shape, rng):
    """As the numba kernels' DGC test: normal values, zeros, ties, values packed in a few
    strata (fewer than k pass the lowered threshold), all zeros, normal again."""
    normal = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    zeros = normal.copy()
    zeros.flat[::3] = 0.0
    ties = np.round(normal * 100).astype(np.float32) / 100
    packed = np.zeros(shape, np.float32)
    n = packed.size
    packed.flat[n // 2:n // 2 + n // 100] = rng.uniform(0.5, 1.5, n // 100).astype(np.float32)
    return [normal, zeros, ties, packed, np.zeros(shape, np.float32), normal * 3]


@pytest.mark.parametrize("shape", [(1000, 70), (300, 1001)])
@pytest.mark.parametrize("spec", DGC_SPECS)
def test_dgc_same_bits_as_numpy(spec, shape, monkeypatch):
    """Momentum correction (plain and Nesterov, with and without masking), the sampled
    threshold and its correction loop, top-k of the candidates or every value that
    passes (unused slots empty), over steps; the warm-up's densities by epoch."""
    rng = np.random.default_rng(zlib.crc32(f"{spec}{shape}".encode()))
    xs = _dgc_data(shape, rng)
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    epochs = [0, 1, 2, 3, 3, 3] if "warmup_epochs=3" in spec else [0] * len(xs)
    calls = _spy(monkeypatch, DGC)
    short = 0
    for step, (x, epoch) in enumerate(zip(xs, epochs)):
        ref.set_epoch(epoch)
        tfc.set_epoch(epoch)
        er = _reference(ref, x, "w", monkeypatch)
        et = tfc.encode(tf.constant(x), "w")
        assert _bytes(et.payload.numpy()) == _bytes(er.payload), (spec, step)
        for key in ("u", "v"):
            np.testing.assert_array_equal(tfc.states["w"][key].numpy(), ref.states["w"][key],
                                          err_msg=f"{key} step {step}")
        np.testing.assert_array_equal(tfc.aggregate([et.payload], et).numpy(),
                                      ref.aggregate([er.payload], er))
        short += not et.ctx.valid.numpy().all()
    assert len(calls) == len(xs)
    if spec == "dgc:ratio=0.01,warmup_epochs=0" and shape == (1000, 70):  # the packed step
        assert short >= 1  # sent fewer than k


def test_dgc_op_lowers_a_sample_that_overstates_the_threshold(monkeypatch):
    """Every sampled position holds a large value and nothing else comes near: the sampled
    threshold is far above the k-th largest, so the op's candidates (collected at the
    threshold) fall short and the correction loop lowers it (a pass counting every value);
    the same bits as the reference, step after step."""
    from hvd_compress.core.base import TensorMeta
    spec, shape = "dgc:ratio=0.01,warmup_epochs=0", (200, 1000)
    rng = np.random.default_rng(11)
    ref = build(spec, NUMPY_TF)
    meta = TensorMeta("w", shape, "float32")
    xs = []
    for step in range(2):
        x = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
        pos, want = ref.sample_plan(meta, step)
        x.flat[np.asarray(pos)] = rng.uniform(0.9, 1.1, len(pos)).astype(np.float32)
        xs.append(x)
    # the sample's threshold is its 20th largest, about the 20th largest of the tensor: far
    # fewer than 0.8 k reach it; lowered once, all 2,000 set values do, and they are sent
    assert want == 20 and ref.k_for(meta) == len(pos) == 2000
    first = _reference(build(spec, NUMPY_TF), xs[0], "w", monkeypatch).ctx
    np.testing.assert_array_equal(np.asarray(first.indices)[np.asarray(first.valid)],
                                  np.sort(np.asarray(ref.sample_plan(meta, 0)[0])))
    _assert_sparse_steps(spec, xs, monkeypatch, state=("u", "v"))


@pytest.mark.parametrize("spec", ["randomk:ratio=0.01", "randomk:ratio=0.1,unbiased=true",
                                  "randomk:ratio=0.1,unbiased=true,ef=true", "randomk:ratio=1"])
@pytest.mark.parametrize("size", [1, 7, 1000, 300_001])
def test_randomk_same_bits_as_numpy(spec, size, monkeypatch):
    rng = np.random.default_rng(zlib.crc32(f"{spec}{size}".encode()))
    _assert_sparse_steps(spec, [_sparse_data(kind, size, rng) for kind in ("normal", "sparse", "normal")],
                         monkeypatch)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01,warmup_epochs=0", "randomk:ratio=0.01"])
def test_sparsifiers_same_bits_traced_with_variable_state(spec, monkeypatch):
    from hvd_compress.tensorflow import compressor
    comp, ref = compressor(spec), build(spec, NUMPY_TF)
    calls = _spy(monkeypatch, type(ref))
    shape = (301, 233)

    @tf.function
    def step(x):
        enc = comp.encode(x, "w")
        received = enc.payload if comp.core.summable else [enc.payload]
        return enc.payload, comp.aggregate(received, enc)

    rng = np.random.default_rng(5)
    for _ in range(3):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        er = _reference(ref, x, "w", monkeypatch)
        payload, dense = step(tf.constant(x))
        assert _bytes(payload.numpy()) == _bytes(er.payload)
        received = er.payload if ref.summable else [er.payload]
        np.testing.assert_array_equal(dense.numpy(), ref.aggregate(received, er).reshape(shape))
        for key in ("residual", "u", "v"):
            if key in ref.states["w"]:
                np.testing.assert_array_equal(comp.tensor_state["w"][key].numpy(), ref.states["w"][key])
    assert calls  # traced once, with the fused op


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.01,ef=false", "randomk:ratio=0.01",
                                  "randomk:ratio=0.01,unbiased=true", "dgc:ratio=0.01,warmup_epochs=0"])
def test_sparsifiers_non_finite_input(spec, bad, monkeypatch):
    """The reference's payload (selected from the cleaned values, sent as NaN), its decoded
    sum, and the state as it was before the step."""
    rng = np.random.default_rng(1)
    shape = (401, 401)  # two stretches
    x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    y = x.copy()
    y.flat[100_000] = bad  # in the second stretch
    y.flat[5] = 1.0  # a value the selection takes
    _assert_sparse_steps(spec, [x, y, x], monkeypatch, state=("residual", "u", "v"))


def test_sparsifiers_take_the_fused_path_where_it_applies(monkeypatch):
    for spec in ("topk", "randomk", "dgc"):
        assert TFB.fused_encoder(build(spec, TFB), 1) is not None, spec
    for spec in ("topk+qsgd", "randomk+fp16"):
        assert TFB.fused_encoder(build(spec, TFB), 1) is None, spec
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    assert TFB.fused_encoder(build("topk", TFB), 1) is None
    x = tf.constant(np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(build("topk:ratio=0.2", TFB).encode(x, "w").payload.numpy(),
                                  build("topk:ratio=0.2", NUMPY_TF).encode(x.numpy(), "w").payload)


def test_stratified_op_same_indices_as_the_reference(monkeypatch):
    """core.sampling's stratified indices and sizes from the op: the numpy chain's, for k = n,
    k = 1, remainders, strata across the op's blocks of 65,536 and a tensor of more than
    2**32 elements (nothing allocated: k entries only), eagerly and traced with the step a
    variable; the op is what the TF backend's hook gives."""
    from hvd_compress.core.sampling import STRATIFIED, stratified_indices, stream_keys
    calls = []
    real = fused_ops._stratified
    monkeypatch.setattr(fused_ops, "_stratified", lambda *a: calls.append(1) or real(*a))
    cases = [(1, 1), (7, 7), (10, 3), (1000, 999), (2**20 + 3, 70_000), (3 * 2**31 + 7, 1000)]
    for n, k in cases:
        for step in (0, 9):
            want = stratified_indices(NUMPY, n, k, *stream_keys(NUMPY, 3, "w", step, 2))
            got = stratified_indices(TFB, n, k, *stream_keys(TFB, 3, "w", step, 2))
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g.numpy(), w, err_msg=f"n={n} k={k} step={step}")
    assert len(calls) == 2 * len(cases)
    step = tf.Variable(0, dtype=tf.int64)
    traced = tf.function(lambda: stratified_indices(TFB, 12345, 100, *stream_keys(TFB, 3, "w", step, 2)))
    for s in (4, 5):
        step.assign(s)
        want = stratified_indices(NUMPY, 12345, 100, *stream_keys(NUMPY, 3, "w", s, 2))
        np.testing.assert_array_equal(traced()[0].numpy(), want[0])
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "0")
    assert TFB.fused_encoder(STRATIFIED, 1) is None  # the chain (a GPU visible, or turned off)


@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_scatter_add_op_adds_in_slot_order(itype):
    """Zeros or a given tensor plus values at indices, duplicates added in slot order (as
    numpy's add.at), -0.0 + 0.0 as numpy, eagerly and traced."""
    rng = np.random.default_rng(6)
    n = 70_001
    idx = np.concatenate([rng.integers(0, n, 5000), [3, 3, 3, 0, 0]]).astype(itype)
    values = np.concatenate([rng.standard_normal(5000), [1e8, 1.0, -1e8, -0.0, 0.0]]).astype(np.float32)
    acc = rng.standard_normal(n).astype(np.float32)
    want_zeros = NUMPY.scatter_add(n, idx, values)
    want_acc = NUMPY.index_add(acc.copy(), idx, values)
    t_idx, t_values = tf.constant(idx), tf.constant(values)
    np.testing.assert_array_equal(TFB.scatter_add(n, t_idx, t_values).numpy(), want_zeros)
    np.testing.assert_array_equal(TFB.index_add(tf.constant(acc), t_idx, t_values).numpy(), want_acc)
    traced = tf.function(lambda a, i, v: TFB.index_add(a * 1.0, i, v))
    np.testing.assert_array_equal(traced(tf.constant(acc), tf.constant(idx), tf.constant(values)).numpy(),
                                  want_acc)
    with pytest.raises(tf.errors.InvalidArgumentError):
        TFB.scatter_add(n, tf.constant(np.array([n], itype)), tf.constant([1.0], tf.float32)).numpy()


SPARSIFIERS_BY_THREADS = """
import sys, hashlib, numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
from hvd_compress.core import build
from hvd_compress.tensorflow import TensorFlowBackend
rng = np.random.default_rng(0)
x = (rng.standard_normal((1001, 1201)) * 1e-2).astype(np.float32)
x.flat[rng.choice(x.size, 3000, replace=False)] = 0.25
out = []
for spec in ['topk:ratio=0.001', 'topk:ratio=0.3', 'randomk:ratio=0.01', 'dgc:ratio=0.01,warmup_epochs=0']:
    c = build(spec, TensorFlowBackend())
    for _ in range(2):
        e = c.encode(tf.constant(x), 'w')
        out.append(e.payload.numpy().tobytes())
        out.append(c.aggregate(e.payload if c.summable else [e.payload], e).numpy().tobytes())
    st = c.states['w']
    out += [st[k].numpy().tobytes() for k in sorted(st) if hasattr(st[k], 'numpy')]
print(hashlib.sha256(b''.join(out)).hexdigest())
"""
THREAD_DIGESTS.add("fused-sparsifiers", SPARSIFIERS_BY_THREADS)


def test_sparsifiers_do_not_depend_on_the_number_of_threads():
    """The same payloads and states with one intra-op thread (a fresh process) as with two."""
    digests = THREAD_DIGESTS.digests("fused-sparsifiers")
    assert len(digests[0]) == 64 and digests[0] == digests[1]
