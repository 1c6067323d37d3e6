"""Properties of the numpy reference core, checked over many shapes, dtypes and values."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_compress.core import NUMPY, Exchange, Loopback, build, new_stats, warmup_density
from hvd_compress.core.bitpack import packed_nbytes
from hvd_compress.core.powersgd import matrix_shape

ALL_SPECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1",
             "randomk:ratio=0.1,unbiased=true", "dgc:ratio=0.01", "dgc:ratio=0.05,compress_1d=true",
             "qsgd:levels=7",
             "qsgd:levels=16,bucket=64", "terngrad", "onebit", "threshold:tau=0.01",
             "powersgd:rank=2", "topk:ratio=0.1+qsgd:levels=16", "randomk:ratio=0.1+fp16",
             "dgc:ratio=0.05+terngrad", "topk:ratio=0.2+onebit", "topk:ratio=0.2+threshold:tau=0.1",
             "signsgd", "signum", "efsignsgd", "natural", "uniform",
             "uniform:bits=2,bucket=16,stochastic=false", "eightbit", "topk:ratio=0.1+natural",
             "randomk:ratio=0.1+uniform:bits=8", "sketchml", "sketchml:buckets=300,sample=64",
             "thresholdv", "thresholdv:tau=0.5,ef=false", "adaq", "adaq:ratio=0.3",
             "inceptionn", "inceptionn:bound=1e-6"]
# Compressors with error feedback (or DGC's equivalent memory with momentum 0).
EF_SPECS = ["topk:ratio=0.1", "randomk:ratio=0.1", "onebit", "threshold:tau=0.01",
            "qsgd:levels=3,ef=true", "terngrad:ef=true", "topk:ratio=0.1+qsgd:levels=16",
            "randomk:ratio=0.2+fp16", "topk:ratio=0.2+onebit", "dgc:ratio=0.05,momentum=0",
            "powersgd:rank=1", "efsignsgd", "uniform:ef=true,stochastic=false", "eightbit:ef=true",
            "natural:ef=true", "topk:ratio=0.2+efsignsgd", "sketchml:buckets=8,ef=true", "thresholdv:tau=0.3",
            "adaq:ratio=0.2", "inceptionn:bound=0.1,ef=true"]

shapes = st.one_of(
    st.just(()), st.just((1,)),
    st.integers(1, 300).map(lambda n: (n,)),
    st.tuples(st.integers(1, 20), st.integers(1, 20)),
    st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5)))
dtypes = st.sampled_from([np.float32, np.float64, np.float16])
value_kinds = st.sampled_from(["normal", "zeros", "constant", "tiny", "huge"])


def make(shape, dtype, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        x = np.zeros(shape)
    elif kind == "constant":
        x = np.full(shape, 0.37)
    elif kind == "tiny":
        x = rng.standard_normal(shape) * 1e-30
    elif kind == "huge":
        x = rng.standard_normal(shape) * (1e30 if dtype != np.float16 else 1e3)
    else:
        x = rng.standard_normal(shape)
    return np.asarray(x, dtype=dtype)


def single_rank(comp, x, name="t", noise=None, stats=None):
    """One rank's exchange through the engine: the sum over one rank is that rank's
    decoded payload.  Returns the sum and the final round's Encoded."""
    engine = Exchange(comp, Loopback(), average=False)
    stats = new_stats() if stats is None else stats
    batch = engine.send([x], [name], stats, noises=None if noise is None else [noise])
    (out,) = engine.receive(batch, stats)
    return out, batch.encoded[0]


def sent_bytes(comp, x, name="t"):
    """What one exchange of ``x`` sends from this rank, every round counted."""
    stats = new_stats()
    single_rank(comp, x, name, stats=stats)
    return stats["bytes_sent"]


# -- shapes, dtypes, round trips ---------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, dtype=dtypes, kind=value_kinds, spec=st.sampled_from(ALL_SPECS))
def test_decode_keeps_shape_and_dtype(shape, dtype, kind, spec):
    x = make(shape, dtype, kind)
    comp = build(spec)
    out, enc = single_rank(comp, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    if not (kind == "huge" and "fp16" in spec):  # 1e30 does not fit half precision
        assert np.all(np.isfinite(out.astype(np.float64)))
    if comp.collective == "allgather":
        assert enc.payload.dtype == np.uint8 and enc.payload.nbytes == enc.nbytes


@settings(max_examples=30, deadline=None)
@given(shape=shapes, dtype=dtypes, kind=value_kinds)
def test_none_and_fp16_round_trip_as_documented(shape, dtype, kind):
    x = make(shape, dtype, kind)
    out, _ = single_rank(build("none"), x)
    np.testing.assert_array_equal(out, x)  # exact
    out16, _ = single_rank(build("fp16"), x)
    with np.errstate(over="ignore"):
        expect = x.astype(np.float32).astype(np.float16).astype(dtype)
    np.testing.assert_array_equal(out16, expect)  # one rounding to half precision


# -- nothing lost ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", EF_SPECS)
@pytest.mark.parametrize("shape", [(1,), (37,), (12, 9), (3, 4, 5)])
def test_nothing_lost_with_error_feedback(spec, shape):
    comp = build(spec)
    rng = np.random.default_rng(7)
    total_in = np.zeros(int(np.prod(shape)), np.float64)
    total_sent = np.zeros_like(total_in)
    for _ in range(20):
        x = rng.standard_normal(shape).astype(np.float32)
        out, _ = single_rank(comp, x, "w")
        total_in += x.ravel()
        total_sent += out.ravel()
    st_ = comp.states.get("w", {})
    residual = st_["v"] if "v" in st_ else st_.get("residual", np.zeros_like(total_in))
    np.testing.assert_allclose(total_sent + residual, total_in, rtol=0, atol=2e-5 * 20)


def test_dgc_keeps_unsent_momentum_in_its_memory():
    """With momentum m, v_T + sum(sent) equals the sum of the momentum vectors u_t."""
    comp = build("dgc:ratio=0.05,momentum=0.9,warmup_epochs=0")
    rng = np.random.default_rng(3)
    u = np.zeros(200)
    sum_u = np.zeros(200)
    sent = np.zeros(200)
    for _ in range(15):
        g = rng.standard_normal((20, 10)).astype(np.float32)
        u = 0.9 * u + g.ravel()
        sum_u += u
        out, enc = single_rank(comp, g, "w")
        sent += out.ravel()
        hit = np.zeros(200, bool)
        hit[enc.ctx.indices[enc.ctx.valid]] = True
        u[hit] = 0.0  # momentum factor masking
        np.testing.assert_allclose(comp.states["w"]["u"], u, atol=1e-4)
    np.testing.assert_allclose(comp.states["w"]["v"] + sent, sum_u, atol=1e-3)


def test_dgc_sends_vectors_whole_with_momentum():
    """Tensors of fewer than two dimensions: all of u = m*u + g is sent, nothing kept back."""
    comp = build("dgc:ratio=0.01,momentum=0.9")
    rng = np.random.default_rng(4)
    u = np.zeros(300)
    for _ in range(5):
        g = rng.standard_normal(300).astype(np.float32)
        u = 0.9 * u + g
        out, enc = single_rank(comp, g, "b")
        np.testing.assert_allclose(out, u, rtol=1e-6, atol=1e-6)
        assert enc.nbytes == 4 * 300  # values only: no indices
    assert not np.any(comp.states["b"]["v"])
    sparse = build("dgc:ratio=0.01,compress_1d=true,warmup_epochs=0")
    out, enc = single_rank(sparse, rng.standard_normal(300).astype(np.float32), "b")
    assert np.count_nonzero(out) == 3 and enc.nbytes == 3 * 8


def _each_rank_decodes_all(comps, grads):
    """One step of ranks ``comps`` (one gradient each): their encodings, and what each
    rank aggregates from every rank's payload (flat)."""
    encs = [c.encode(x, "w") for c, x in zip(comps, grads)]
    return encs, [np.asarray(c.aggregate([e.payload for e in encs], enc)).ravel()
                  for c, enc in zip(comps, encs)]


def test_dgc_at_density_one_is_momentum_sgd():
    """At density 1 (``ratio=1``, or a dense warm-up epoch) the authors compress nothing:
    u = m*u + g is sent whole, momentum kept (no masking), v untouched.  Masking every
    sent coordinate used to make it SGD without momentum.  Two ranks, each decoding
    both payloads, get the sum of both momenta."""
    rng = np.random.default_rng(5)
    for spec, dense_steps in (("dgc:ratio=1", 6),
                              ("dgc:ratio=0.01,warmup_coeff=1,warmup_epochs=1,steps_per_epoch=3", 3)):
        comps = [build(spec, rank=r, world_size=2) for r in range(2)]
        u = np.zeros((2, 400))
        for t in range(6):
            g = rng.standard_normal((2, 20, 20)).astype(np.float32)
            u = 0.9 * u + g.reshape(2, -1)
            encs, outs = _each_rank_decodes_all(comps, g)
            np.testing.assert_array_equal(outs[0], outs[1])
            if t < dense_steps:
                np.testing.assert_allclose(outs[0], u.sum(axis=0), rtol=1e-5, atol=1e-5)
                assert encs[0].nbytes == 8 * 400  # n (index, value) pairs
                assert not any(np.any(c.states["w"]["v"]) for c in comps)
            else:  # past the dense warm-up: 4 of 400 sent per rank
                assert np.count_nonzero(outs[0]) <= 8 and encs[0].nbytes == 4 * 8
                assert all(np.any(c.states["w"]["v"]) for c in comps)
    # with a quantizer, density 1 keeps the sparse path: v keeps the quantizer's error
    comp = build("dgc:ratio=1,momentum=0+terngrad")
    comp.encode(rng.standard_normal((20, 20)).astype(np.float32), "w")
    assert np.any(comp.states["w"]["v"])


def test_dgc_payloads_decode_alike_on_every_rank_when_k_is_n():
    """k = n below density 1 (d > 2/3 on a tiny tensor that is still sampled): the
    correction loop can leave slots empty, so the indices must travel; every rank
    decodes both payloads to the same aggregate, the sum of what each sent."""
    rng = np.random.default_rng(6)
    comps = [build("dgc:ratio=0.9,warmup_epochs=0,momentum=0", rank=r, world_size=2)
             for r in range(2)]
    for _ in range(4):
        g = rng.standard_normal((2, 3, 3)).astype(np.float32)
        encs, outs = _each_rank_decodes_all(comps, g)
        sent = sum(np.asarray(c.aggregate([e.payload], e)).ravel() for c, e in zip(comps, encs))
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], sent)


# -- unbiasedness and variance ---------------------------------------------------------------

def _draws(spec, x, n_draws, seed=0):
    comp = build(spec)
    rng = np.random.default_rng(seed)
    out = np.empty((n_draws, x.size))
    for i in range(n_draws):
        noise = rng.random(x.size, dtype=np.float32)
        out[i] = single_rank(comp, x, "w", noise=noise)[0].ravel()
    return out


@pytest.mark.parametrize("spec", ["qsgd:levels=2,bucket=16", "qsgd:levels=7", "terngrad:clip=0"])
@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_stochastic_quantizers_are_unbiased(spec):
    x = np.random.default_rng(1).standard_normal(48).astype(np.float32)
    draws = _draws(spec, x, 3000)
    mean, sd = draws.mean(axis=0), draws.std(axis=0)
    z = np.abs(mean - x) / (sd / math.sqrt(len(draws)) + 1e-12)
    assert np.max(z) < 5.0, (spec, np.max(z))


@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_terngrad_is_unbiased_for_the_clipped_input():
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    x[5] = 40.0  # far beyond 2.5 sigma: clipped
    draws = _draws("terngrad", x, 3000)
    sigma = np.sqrt(np.mean((x.astype(np.float64) - x.mean()) ** 2))
    clipped = np.clip(x, -2.5 * sigma, 2.5 * sigma)
    bound = 5 * draws.std(axis=0) / math.sqrt(3000) + 1e-6 * np.abs(clipped)
    assert np.all(np.abs(draws.mean(axis=0) - clipped) <= bound)
    assert np.all(draws[:, 5] == np.float32(clipped[5]))  # the clipped value is the scale


@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_unbiased_randomk_averages_to_the_input():
    x = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    comp = build("randomk:ratio=0.1,unbiased=true")
    assert comp.ef is False
    draws = np.array([single_rank(comp, x, "w")[0] for _ in range(4000)])  # step changes indices
    z = np.abs(draws.mean(axis=0) - x) / (draws.std(axis=0) / math.sqrt(4000) + 1e-12)
    assert np.max(z) < 5.0


@pytest.mark.parametrize("levels, bucket", [(1, 16), (4, 64), (7, 512)])
@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_qsgd_variance_within_the_paper_bound(levels, bucket):
    x = np.random.default_rng(4).standard_normal(bucket).astype(np.float32)  # one bucket
    draws = _draws(f"qsgd:levels={levels},bucket={bucket}", x, 1500)
    var = np.mean(np.sum((draws - x) ** 2, axis=1))
    bound = min(bucket / levels ** 2, math.sqrt(bucket) / levels) * float(np.sum(x.astype(np.float64) ** 2))
    assert var <= 1.05 * bound, (var, bound)


# -- selection and sizes -----------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 10 ** 6))
def test_topk_keeps_exactly_the_k_largest(n, ratio, seed):
    x = np.random.default_rng(seed).permutation(n).astype(np.float32) + 1.0  # distinct
    x *= np.where(np.random.default_rng(seed + 1).random(n) < 0.5, -1, 1).astype(np.float32)
    comp = build(f"topk:ratio={ratio!r}")
    out, enc = single_rank(comp, x)
    k = max(1, min(n, math.ceil(ratio * n - 1e-9)))
    expect = np.zeros(n, np.float32)
    top = np.argsort(-np.abs(x))[:k]
    expect[top] = x[top]
    np.testing.assert_array_equal(out, expect)
    assert enc.nbytes == 8 * k


def _expected_nbytes(spec, shape):
    n = int(np.prod(shape))
    name = spec.split(":")[0]
    k = max(1, math.ceil(0.1 * n - 1e-9))
    rows_cols = matrix_shape(build("none").meta_for(np.zeros(shape, np.float32)))
    return {
        "none": 4 * n, "fp16": 2 * n, "bf16": 2 * n,
        "topk": 8 * k, "randomk": 4 * k,
        "onebit": packed_nbytes(n, 1) + 8 * (n // shape[0] if len(shape) >= 2 else 1),
        "terngrad": packed_nbytes(n, 2) + 4, "threshold": packed_nbytes(n, 2) + 4,
        "qsgd": packed_nbytes(n, 4) + 4 * math.ceil(n / 512),
        "powersgd": (4 * sum(rows_cols) * 2 if len(shape) >= 2 and sum(rows_cols) * 2 < n
                     else 4 * n),
    }[name]


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:ratio=0.1", "randomk:ratio=0.1",
                                  "onebit", "terngrad", "threshold", "qsgd:levels=7", "powersgd"])
@pytest.mark.parametrize("shape", [(1,), (9,), (1001,), (40, 30), (16, 3, 3, 3)])
def test_payload_size_follows_the_formula(spec, shape):
    comp = build(spec)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    meta = comp.meta_for(x, "t")
    assert sent_bytes(comp, x) == _expected_nbytes(spec, shape) == comp.payload_nbytes(meta)


def test_large_tensor_ratios():
    x = (np.random.default_rng(0).standard_normal(2_000_003) * 1e-3).astype(np.float32)
    fp32 = 4 * x.size
    expect_min = {"onebit": 30, "terngrad": 15, "threshold": 15, "topk:ratio=0.01": 49,
                  "randomk:ratio=0.01": 99, "qsgd:levels=7": 7.8, "fp16": 2}
    for spec, ratio in expect_min.items():
        assert fp32 / sent_bytes(build(spec), x) >= ratio, spec


def test_dgc_warmup_schedule():
    """The authors' default coefficient ratio**(1/(W+1)): at 0.1% and 4 epochs, the paper's
    75%, 93.75%, 98.4375%, 99.6% sparsity (to rounding), then 99.9%."""
    densities = [warmup_density(0.001, e, 4) for e in range(6)]
    np.testing.assert_allclose(densities, [0.001 ** ((e + 1) / 5) for e in range(4)] + [0.001] * 2)
    sparsity = [round(100 * (1 - d), 1) for d in densities]
    assert sparsity == [74.9, 93.7, 98.4, 99.6, 99.9, 99.9]
    assert [warmup_density(0.01, e, 1) for e in range(3)] == [0.1, 0.01, 0.01]
    # warmup_coeff=0.25: the paper's quartering, floored at the final density
    assert [warmup_density(0.01, e, 4, 0.25) for e in range(5)] == \
        [0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert build("dgc:ratio=0.01,warmup_coeff=0.25").set_epoch(1)  # the density changed
    assert not build("dgc:ratio=0.01,warmup_epochs=2").set_epoch(0)  # epoch 0 again
    comp = build("dgc:ratio=0.001,steps_per_epoch=2")
    x = np.random.default_rng(0).standard_normal((1000, 100)).astype(np.float32)
    sent = [single_rank(comp, x, "w")[1].nbytes // 8 for _ in range(10)]
    assert sent == [25119, 25119, 6310, 6310, 1585, 1585, 399, 399, 100, 100]


def test_dgc_sends_the_largest_accumulated_values():
    comp = build("dgc:ratio=0.01,warmup_epochs=0,momentum=0")
    x = np.random.default_rng(5).standard_normal((1000, 100)).astype(np.float32)
    out, enc = single_rank(comp, x, "w")
    kept = np.flatnonzero(out)
    assert 0.8 * 1000 <= kept.size <= 1000
    # exactly the largest |x|: no smaller value is sent in place of a larger one
    order = np.argsort(-np.abs(x.ravel()), kind="stable")
    np.testing.assert_array_equal(np.sort(order[:kept.size]), kept)


def test_randomk_indices_shared_by_ranks_and_change_with_step_and_name():
    x = np.ones(1000, np.float32)
    a, b = build("randomk:ratio=0.05", rank=0), build("randomk:ratio=0.05", rank=1)
    ia = [a.encode(x, "w").ctx.indices for _ in range(3)]
    ib = [b.encode(x * 2, "w").ctx.indices for _ in range(3)]
    for p, q in zip(ia, ib):
        np.testing.assert_array_equal(p, q)
        assert len(np.unique(p)) == 50
    assert not np.array_equal(ia[0], ia[1])
    assert not np.array_equal(a.encode(x, "other").ctx.indices, ia[0])
    # the user's global RNG is not touched
    np.random.seed(123)
    before = np.random.random()
    np.random.seed(123)
    a.encode(x, "w")
    assert np.random.random() == before


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31), step=st.integers(0, 2 ** 40), purpose=st.integers(0, 7),
       name=st.text(max_size=12))
def test_stream_keys_from_a_python_step_are_the_array_steps(seed, step, purpose, name):
    """Keys from a Python int step (computed on Python ints) are those of the same step
    as a 0-d int64 array (the backend's operations, as in a traced step), in numpy and
    torch."""
    import torch

    from hvd_compress.core.sampling import stream_keys
    from hvd_compress.torch import TorchBackend
    for B, array in ((NUMPY, np.asarray(step, np.int64)), (TorchBackend(), torch.tensor(step))):
        fast = stream_keys(B, seed, name, step, purpose)
        chain = stream_keys(B, seed, name, array, purpose)
        assert [int(B.to_numpy(k)) for k in fast] == [int(B.to_numpy(k)) for k in chain]
        assert all(0 <= int(B.to_numpy(k)) < 2 ** 32 for k in fast)


# -- bad input, non-finite values, state -------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS)
def test_bad_input_raises_clear_errors(spec):
    comp = build(spec)
    with pytest.raises(TypeError, match="floating point"):
        comp.encode(np.arange(4), "ints")
    with pytest.raises(ValueError, match="empty"):
        comp.encode(np.zeros((0, 3), np.float32), "empty")


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_step_shows_in_output_and_leaves_state_clean(spec, bad):
    comp = build(spec)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 10)).astype(np.float32)
    single_rank(comp, x, "w")
    before = {k: np.copy(v) for k, v in comp.states.get("w", {}).items() if isinstance(v, np.ndarray)}
    poisoned = x.copy()
    poisoned[3, 4] = bad
    with np.errstate(invalid="ignore", over="ignore"):
        out, _ = single_rank(comp, poisoned, "w")
    assert not np.all(np.isfinite(out)), "a non-finite gradient must show in the aggregate"
    after = comp.states.get("w", {})
    for key, value in before.items():
        if key != "q":
            np.testing.assert_array_equal(after[key], value, err_msg=f"{spec}: {key} changed")
        assert np.all(np.isfinite(after[key]))
    out2, _ = single_rank(comp, x, "w")
    assert np.all(np.isfinite(out2)), "the next finite step must be clean"


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "dgc:ratio=0.05", "qsgd", "terngrad",
                                  "powersgd:rank=1", "randomk:ratio=0.1", "onebit"])
def test_state_dict_resumes_bit_identically(spec):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((30, 20)).astype(np.float32) for _ in range(6)]
    a = build(spec)
    for x in xs[:3]:
        single_rank(a, x, "w")
    saved = a.state_dict()
    b = build(spec)
    b.load_state_dict(saved)
    for x in xs[3:]:
        oa, _ = single_rank(a, x, "w")
        ob, _ = single_rank(b, x, "w")
        np.testing.assert_array_equal(oa, ob)


@pytest.mark.parametrize("n", [1 << 20, (1 << 20) + 1, 3_000_001])
@pytest.mark.parametrize("before", [0, 1, 2])
def test_parallel_uniform_draws_are_the_serial_stream(n, before):
    """``fill_uniform`` splits a large draw over threads: the same values as one serial
    draw, from any position (a pending half of a 64-bit output included), and the
    generator left where the serial draw leaves it."""
    from hvd_compress.core.backend import fill_uniform
    serial, split = (np.random.Generator(np.random.PCG64(11)) for _ in range(2))
    serial.random(before, dtype=np.float32)
    split.random(before, dtype=np.float32)
    expected = serial.random(n, dtype=np.float32)
    np.testing.assert_array_equal(fill_uniform(split, np.empty(n, np.float32)), expected)
    np.testing.assert_array_equal(split.random(3, dtype=np.float32), serial.random(3, dtype=np.float32))
    assert split.random() == serial.random()


# -- the average's scaling of a sparse aggregate -------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.01,warmup_epochs=0",
                                  "topk:ratio=0.01+qsgd:levels=7", "randomk:ratio=0.01",
                                  "topk:ratio=0.5"])
def test_a_sparse_aggregate_is_scaled_where_its_payloads_name(spec, backend):
    """``scaled`` touches only the named coordinates when they are few (a pass over the
    tensor saved) and gives the bits :meth:`imul` gives; with many it scales everything.
    Three ranks (1/3 is inexact), ranks naming the same coordinates, DGC's unused slots."""
    n, p = 4000, 3
    if backend == "torch":
        torch = pytest.importorskip("torch")
        from hvd_compress.torch.backend import TorchBackend
        B, to = TorchBackend(), torch.from_numpy
    else:
        from hvd_compress.core.backend import NUMPY as B
        to = np.asarray
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(n).astype(np.float32)
    encs = []
    for r in range(p):
        comp = build(spec, backend=B, rank=r, world_size=p)
        x = shared + 0.1 * rng.standard_normal(n).astype(np.float32)  # mostly the same top-k
        encs.append(comp.encode(to(x.reshape(40, 100)), "w"))
    own = encs[0]
    received = own.payload if comp.summable else [e.payload for e in encs]
    if comp.summable:  # random-k: the allreduce's sum of the payloads
        received = sum((e.payload for e in encs[1:]), encs[0].payload)
    total = comp.aggregate(received, own)
    factor = 1.0 / p
    want = B.to_numpy(B.imul(B.copy(total), factor))
    flat = B.to_numpy(total).reshape(-1).copy()
    touched = flat != 0
    unnamed = ~touched & (np.arange(n) != 0)  # (DGC's unused slots name index 0)
    sentinel = B.copy(total)
    B.flat_view(sentinel)[np.flatnonzero(unnamed)] = 7.0  # marked
    got = B.to_numpy(comp.scaled(sentinel, received, own, factor)).reshape(-1)
    assert np.array_equal(got[touched].view(np.uint32), want.reshape(-1)[touched].view(np.uint32))
    sparse = spec != "topk:ratio=0.5"
    assert unnamed.sum() > (n // 2 if sparse else 0)
    assert np.all(got[unnamed] == (7.0 if sparse else np.float32(7.0) * np.float32(factor)))
    plain = B.to_numpy(comp.scaled(B.copy(total), received, own, factor))
    assert np.array_equal(plain.view(np.uint32), want.view(np.uint32))


# -- aggregating gathered payloads ------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if not build(s).summable
                                  and s not in ("signsgd", "signum")])  # (those vote)
def test_aggregate_is_the_sum_of_the_decodes_and_leaves_the_payloads(spec, backend):
    """Three ranks' gathered payloads of a tensor big enough for the decoders' kept result
    buffers: the aggregate is, bit for bit, the decodes added in rank order (the first
    decode takes the others in place), the payloads are left as received, and a second
    call (two ranks' payloads) writes nowhere the first call's held result lives."""
    shape, p = (512, 520), 3
    if backend == "torch":
        torch = pytest.importorskip("torch")
        from hvd_compress.torch.backend import TorchBackend
        B, to = TorchBackend(), torch.from_numpy
    else:
        B, to = NUMPY, np.asarray
    rng = np.random.default_rng(1)
    comps = [build(spec, backend=B, rank=r, world_size=p) for r in range(p)]
    encs = [c.encode(to((rng.standard_normal(shape) * 1e-2).astype(np.float32)), "w")
            for c in comps]
    received = [e.payload for e in encs]
    before = [np.asarray(B.to_numpy(r)).tobytes() for r in received]
    decoded = [np.asarray(B.to_numpy(comps[0].decode(e.payload, e.meta, e.ctx)), np.float32)
               .reshape(-1) for e in encs]
    want3 = decoded[0] + decoded[1] + decoded[2]
    want2 = decoded[0] + decoded[1]
    first = comps[0].aggregate(received, encs[0])
    second = comps[0].aggregate(received[:2], encs[0])
    assert np.asarray(B.to_numpy(second)).reshape(-1).tobytes() == want2.tobytes()
    assert np.asarray(B.to_numpy(first)).reshape(-1).tobytes() == want3.tobytes()
    assert [np.asarray(B.to_numpy(r)).tobytes() for r in received] == before


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_a_float16_sum_decodes_into_out_as_without_it(backend, dtype):
    """fp16's allreduced sum (and a bf16 sum that travelled as float16) widened straight
    into the caller's buffer: the bits (NaN's included) and dtype of the decode without
    one; a bfloat16 buffer goes through float32 as without one (a direct float16 ->
    bfloat16 copy gives another NaN)."""
    if backend == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    x = np.array([[1.5, -2.0, 65504.0], [np.inf, np.nan, -np.nan]], np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        from hvd_compress.torch.backend import TorchBackend
        B, empty = TorchBackend(), lambda: torch.empty(2, 3, dtype=getattr(torch, dtype))

        def to(a):
            return torch.from_numpy(a.astype(np.float32)).to(getattr(torch, dtype))
    elif backend == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        from hvd_compress.tensorflow.backend import TensorFlowBackend
        B, empty = TensorFlowBackend(), lambda: tf.zeros([2, 3], dtype)

        def to(a):
            return tf.cast(tf.constant(a.astype(np.float32)), dtype)
    else:
        B, empty = NUMPY, lambda: np.empty((2, 3), dtype)

        def to(a):
            return a.astype(dtype)
    for spec in ("fp16", "bf16"):
        comp = build(spec, backend=B)
        with np.errstate(over="ignore", invalid="ignore"):  # 65504 and Inf in bf16/fp16
            enc = comp.encode(to(x), "w")
            payload = B.cast(B.from_bfloat16_bits(enc.payload), "float16") if spec == "bf16" \
                else enc.payload  # (bf16's sum as the allreduce carries it)
        plain = np.asarray(B.to_numpy(comp.decode(payload, enc.meta)))
        into = np.asarray(B.to_numpy(comp.decode(payload, enc.meta, out=empty())))
        assert into.dtype == plain.dtype
        assert into.tobytes() == plain.tobytes(), (spec, into, plain)
