"""TensorFlow runs the reference core's algorithms bit for bit (eager mode)."""

import os
import zlib

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from hvd_compress.core import NUMPY, NumpyBackend, build  # noqa: E402
from hvd_compress.tensorflow import TensorFlowBackend  # noqa: E402
from tests.test_torch_same_bits import SHAPES, SPECS, _bytes, _noise_len  # noqa: E402

TFB = TensorFlowBackend()
NUMPY_TF = NumpyBackend(TFB.layout)  # the numpy reference in TensorFlow's layout (core.layout)


@pytest.fixture(autouse=True, params=["fused", "chain"])
def _quantizer_path(request, monkeypatch):
    """Every test twice: with the quantizers' fused CPU ops, and as chains of TF ops."""
    monkeypatch.setenv("HVD_COMPRESS_FUSED", "1" if request.param == "fused" else "0")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_same_payload_bytes_and_decode_as_numpy(spec, shape):
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    rng = np.random.default_rng(zlib.crc32(repr((spec, shape)).encode()))
    needs_noise = ref.draws_noise
    for step in range(3):
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        meta = ref.meta_for(x, "w")
        noise = rng.random(_noise_len(ref, meta), dtype=np.float32) if needs_noise else None
        er = ref.encode(x, "w", noise=noise)
        et = tfc.encode(tf.constant(x), "w", noise=None if noise is None else tf.constant(noise))
        assert et.nbytes == er.nbytes
        assert _bytes(TFB.to_numpy(et.payload)) == _bytes(er.payload), (spec, shape, step)
        dr = ref.aggregate(er.payload if ref.summable else [er.payload], er)
        dt = tfc.aggregate(et.payload if tfc.summable else [et.payload], et)
        np.testing.assert_array_equal(TFB.to_numpy(dt), dr)


def test_powersgd_matches_numpy_to_rounding():
    ref, tfc = build("powersgd:rank=2", NUMPY_TF), build("powersgd:rank=2", TFB)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((40, 30)).astype(np.float32)
        er, et = ref.encode(x, "w"), tfc.encode(tf.constant(x), "w")
        er, et = ref.next_round(er, er.payload), tfc.next_round(et, et.payload)
        np.testing.assert_allclose(TFB.to_numpy(tfc.aggregate(et.payload, et)),
                                   ref.aggregate(er.payload, er), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "qsgd", "onebit", "dgc:ratio=0.05"])
def test_non_finite_input_keeps_state(spec):
    comp = build(spec, TFB)
    x = tf.random.stateless_normal([30, 20], seed=[1, 2])
    comp.encode(x, "w")
    before = {k: v.numpy() for k, v in comp.states["w"].items() if isinstance(v, tf.Tensor)}
    bad = tf.tensor_scatter_nd_update(x, [[2, 3]], [float("nan")])
    enc = comp.encode(bad, "w")
    out = comp.aggregate([enc.payload], enc)
    assert not np.all(np.isfinite(out.numpy()))
    for key, value in before.items():
        np.testing.assert_array_equal(comp.states["w"][key].numpy(), value)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "dgc:ratio=0.05", "onebit", "threshold:tau=0.01",
                                  "randomk:ratio=0.1", "qsgd:levels=7", "terngrad",
                                  "topk:ratio=0.1+qsgd:levels=16", "fp16", "bf16"])
def test_same_bits_inside_tf_function_with_variable_state(spec):
    """The TF compressor, traced once, keeps its state in variables across calls and gives
    the numpy reference's bytes and decoded sum at every step."""
    from hvd_compress.tensorflow import compressor
    comp = compressor(spec)
    ref = build(spec, NUMPY_TF)
    needs_noise = ref.draws_noise

    @tf.function
    def encode(x, noise):
        enc = comp.encode(x, "w", noise=noise if needs_noise else None)
        return enc.payload, comp.aggregate(enc.payload if comp.core.summable else [enc.payload], enc)

    rng = np.random.default_rng(5)
    for step in range(4):
        x = (rng.standard_normal((40, 30)) * 1e-2).astype(np.float32)
        meta = ref.meta_for(x, "w")
        noise = rng.random(_noise_len(ref, meta), dtype=np.float32)
        er = ref.encode(x, "w", noise=noise if needs_noise else None)
        got, dense = encode(tf.constant(x), tf.constant(noise))
        assert _bytes(TFB.to_numpy(got)) == _bytes(er.payload), (spec, step)
        want = ref.aggregate(er.payload if ref.summable else [er.payload], er)
        np.testing.assert_array_equal(dense.numpy(), want)
    assert encode.experimental_get_tracing_count() <= 2  # 2: the first trace made the variables
    if spec not in ("fp16", "bf16"):  # casts keep no state
        assert int(comp.tensor_state["w"]["step"].numpy()) == 4


def test_compressor_state_checkpoints_with_tf_train_checkpoint(tmp_path):
    from hvd_compress.tensorflow import compressor
    a = compressor("topk:ratio=0.1")
    xs = [tf.random.stateless_normal([50], seed=[i, 0]) for i in range(6)]
    for x in xs[:3]:
        a.encode(x, "w")
    path = tf.train.Checkpoint(compressor=a).save(str(tmp_path / "ckpt"))
    b = compressor("topk:ratio=0.1")
    tf.train.Checkpoint(compressor=b).restore(path)
    for x in xs[3:]:
        pa, pb = a.encode(x, "w").payload, b.encode(x, "w").payload
        assert _bytes(pa.numpy()) == _bytes(pb.numpy())


def _large_cases():
    rng = np.random.default_rng(7)
    plain = rng.standard_normal(200_000).astype(np.float32)
    ties = np.round(plain * 4) / 4  # many equal magnitudes at the k-th
    short = plain.copy()  # the strided sample's top is rich, the rest poor: the fallback
    short[::12][:60] = 100 + np.arange(60, dtype=np.float32)
    return {"plain": plain, "ties": ties, "sample_falls_short": short}


@pytest.mark.parametrize("case", ["plain", "ties", "sample_falls_short"])
@pytest.mark.parametrize("spec", ["topk:ratio=0.001", "dgc:ratio=0.001"])
@pytest.mark.parametrize("traced", [False, True])
def test_large_tensor_selection_same_bits(case, spec, traced):
    """Large tensors take the sampled k-th largest and tf.where compaction (no GPU here):
    the same indices as numpy, ties to the lower index, eager and traced."""
    from hvd_compress.core.sparsifiers import topk_indices
    from hvd_compress.tensorflow.backend import _host_only
    x = _large_cases()[case]
    k = 200
    mag = np.abs(x)

    @tf.autograph.experimental.do_not_convert  # as the library's entry points: the core needs no
    def select(m):                              # AutoGraph (no Python control flow on values)
        return topk_indices(TFB, m, k)

    got = (tf.function(select) if traced else select)(tf.constant(mag))
    np.testing.assert_array_equal(TFB.to_numpy(got), topk_indices(NUMPY, mag, k))
    ref, tfc = build(spec, NUMPY_TF), build(spec, TFB)
    for step in range(2):
        er, et = ref.encode(x, "w"), tfc.encode(tf.constant(x), "w")
        assert _bytes(TFB.to_numpy(et.payload)) == _bytes(er.payload), (case, step)
    assert _host_only() == (not tf.config.list_physical_devices("GPU"))
