"""PowerSGD's compiled TensorFlow CPU products (hvd_compress/tensorflow/fused/lowrank_ops.cc).

``M Q``, ``M^T P``, ``P Q^T``, ``M - P Q^T`` and the one-pass finiteness check
agree with float64 products to float32 rounding on shapes across their stripes,
chunks and lanes; PowerSGD built on them gives the numpy reference's results (to
the tolerance of the cross-framework test), eager and inside ``tf.function``, and
keeps its state through a non-finite step.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from hvd_compress.core import NumpyBackend, build  # noqa: E402
from hvd_compress.tensorflow import TensorFlowBackend, fused_ops  # noqa: E402
from hvd_compress.tensorflow.backend import _host_only  # noqa: E402
from tests.harness import THREAD_DIGESTS  # noqa: E402

TFB = TensorFlowBackend()
NUMPY_TF = NumpyBackend(TFB.layout)  # the numpy reference in TensorFlow's layout (core.layout)
# rows x cols, rank: one element; odd sizes; across 8-wide lanes and 64-element spans (M Q),
# 16-row groups and blocks of several groups (M^T P), 1024-column chunks (P Q^T)
SHAPES = [(1, 1, 1), (7, 9, 2), (33, 300, 3), (5, 2100, 16), (130, 1037, 1), (2000, 70, 2)]


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1")


@pytest.fixture
def ops():
    if not _host_only():
        pytest.skip("the compiled products run where no GPU is visible")
    lib = fused_ops.lowrank()
    assert lib is not None, fused_ops.error()
    return lib


def _close(got, want):
    np.testing.assert_allclose(got.numpy(), want.astype(np.float32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows, cols, r", SHAPES)
def test_products_match_float64(ops, rows, cols, r):
    rng = np.random.default_rng(rows * 1000 + cols)
    m, p, q = (rng.standard_normal(s).astype(np.float32) for s in ((rows, cols), (rows, r), (cols, r)))
    m64, p64, q64 = (a.astype(np.float64) for a in (m, p, q))
    _close(ops.hvdc_matmul(m, q), m64 @ q64)
    _close(ops.hvdc_matmul_t(m, p), m64.T @ p64)
    _close(ops.hvdc_low_rank(p, q), p64 @ q64.T)
    _close(ops.hvdc_sub_low_rank(m, p, q), m64 - (p64 @ q64.T).astype(np.float32))
    # the backend takes them for thin factors
    _close(TFB.matmul(tf.constant(m), tf.constant(p), transpose_a=True), m64.T @ p64)
    _close(TFB.subtract_product(tf.constant(m), tf.constant(p), tf.constant(q)),
           m64 - (p64 @ q64.T).astype(np.float32))


def test_wide_factors_and_bad_shapes(ops):
    with pytest.raises(tf.errors.InvalidArgumentError):
        ops.hvdc_matmul(tf.zeros([4, 5]), tf.zeros([5, fused_ops.MAX_RANK + 1]))
    with pytest.raises(tf.errors.InvalidArgumentError):
        ops.hvdc_sub_low_rank(tf.zeros([4, 5]), tf.zeros([4, 2]), tf.zeros([6, 2]))
    # the backend sends wider factors to tf.matmul
    a, b = tf.ones([3, 20]), tf.ones([4, 20])
    np.testing.assert_array_equal(TFB.matmul(a, b, transpose_b=True).numpy(), np.full((3, 4), 20.0))


@pytest.mark.parametrize("n", [1, 9, 65536 * 2 + 13])
def test_all_finite(ops, n):
    x = np.zeros(n, np.float32)
    assert bool(ops.hvdc_all_finite(x))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[-1] = bad
        assert not bool(ops.hvdc_all_finite(y))
        assert not bool(TFB.all_finite(tf.constant(y)))
    big = np.full((3, 4), np.finfo(np.float32).max, np.float32)
    assert bool(ops.hvdc_all_finite(big))


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("spec, shape", [("powersgd:rank=2", (40, 300)), ("powersgd:rank=1", (17, 3, 5))])
def test_powersgd_matches_numpy_eager_and_traced(fused, spec, shape, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", fused)
    from hvd_compress.tensorflow import compressor
    ref, eager, comp = build(spec, NUMPY_TF), build(spec, TFB), compressor(spec)

    @tf.function
    def step(x):
        enc = comp.encode(x, "w")
        enc = comp.next_round(enc, enc.payload)
        return comp.aggregate(enc.payload, enc)

    rng = np.random.default_rng(3)
    for _ in range(3):
        x = rng.standard_normal(shape).astype(np.float32)
        er, et = ref.encode(x, "w"), eager.encode(tf.constant(x), "w")
        er, et = ref.next_round(er, er.payload), eager.next_round(et, et.payload)
        want = ref.aggregate(er.payload, er)
        np.testing.assert_allclose(eager.aggregate(et.payload, et).numpy(), want, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(step(tf.constant(x)).numpy(), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(TFB.to_numpy(eager.states["w"]["residual"]), ref.states["w"]["residual"],
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_powersgd_non_finite_step_keeps_state(fused, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_FUSED", fused)
    comp = build("powersgd:rank=2", TFB)
    x = tf.random.stateless_normal([30, 20], seed=[1, 2])
    enc = comp.encode(x, "w")
    enc = comp.next_round(enc, enc.payload)
    comp.aggregate(enc.payload, enc)
    before = {k: v.numpy() for k, v in comp.states["w"].items() if isinstance(v, tf.Tensor)}
    bad = tf.tensor_scatter_nd_update(x, [[2, 3]], [float("nan")])
    enc = comp.encode(bad, "w")
    enc = comp.next_round(enc, enc.payload)
    out = comp.aggregate(enc.payload, enc)
    assert not np.any(np.isfinite(out.numpy()))
    for key, value in before.items():
        np.testing.assert_array_equal(comp.states["w"][key].numpy(), value)


POWERSGD_BY_THREADS = """
import sys, hashlib, numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
from hvd_compress.core import build
from hvd_compress.tensorflow import TensorFlowBackend
x = tf.constant(np.random.default_rng(0).standard_normal((3000, 700)).astype(np.float32))
c = build('powersgd:rank=3', TensorFlowBackend())
e = c.encode(x, 'w'); out = [e.payload]
e = c.next_round(e, e.payload); out += [e.payload, c.states['w']['residual']]
out.append(c.aggregate(e.payload, e))
print(hashlib.sha256(b''.join(t.numpy().tobytes() for t in out)).hexdigest())
"""
THREAD_DIGESTS.add("lowrank", POWERSGD_BY_THREADS)


def test_results_do_not_depend_on_the_number_of_threads(ops):
    """The same PowerSGD step (every product) with one intra-op thread as with two."""
    digests = THREAD_DIGESTS.digests("lowrank")
    assert len(digests[0]) == 64 and digests[0] == digests[1]
