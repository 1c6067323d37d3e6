"""The catalogue's sign and level compressors (signSGD, Signum, EF-signSGD, natural
compression, uniform max-min, 8-bit): worked examples with exact payload bytes,
the papers' rules, unbiasedness and majority vote, against hand-made numbers."""

import math
import struct

import numpy as np
import pytest

from hvd_compress import spec as specmod
from hvd_compress.core import Exchange, Loopback, build, new_stats, registry
from hvd_compress.core.levels import dynamic_tree_levels
from tests.test_core_properties import single_rank

NEW = ["signsgd", "signum", "efsignsgd", "natural", "uniform", "eightbit", "sketchml", "thresholdv",
       "adaq", "inceptionn"]


def _f32(v):
    return struct.pack("<f", v)


def _aggregate(spec, xs, average=True, noises=None):
    """The engine's result for ranks 0..p-1 sending ``xs``: every rank's compressor
    encodes, the payloads are gathered in rank order, rank 0 aggregates."""
    comps = [build(spec, rank=r, world_size=len(xs)) for r in range(len(xs))]
    encs = [c.encode(x, "w", noise=None if noises is None else noises[r])
            for r, (c, x) in enumerate(zip(comps, xs))]
    total = comps[0].aggregate([e.payload for e in encs], encs[0])
    return total / len(xs) if average else total


# -- worked examples, byte for byte ------------------------------------------------------------

def test_signsgd_payload_is_unit_scale_and_sign_bits():
    x = np.array([0.5, -2.0, 0.0, 1e-3, -1e-3], np.float32)
    enc = build("signsgd").encode(x, "w")
    # bits (LSB first) 1 0 1 1 0: byte 0b01101 = 13; 0 counts as positive
    assert enc.payload.tobytes() == _f32(1.0) + bytes([13])
    assert enc.nbytes == 5
    out, _ = single_rank(build("signsgd:vote=false"), x)
    np.testing.assert_array_equal(out, [1, -1, 1, 1, -1])


def test_majority_vote_and_mean_of_signs():
    xs = [np.array([1, 1, -1, -1, 2], np.float32),
          np.array([1, -1, -1, 1, -3], np.float32),
          np.array([-1, 1, -1, 1, -4], np.float32)]
    np.testing.assert_array_equal(_aggregate("signsgd", xs), [1, 1, -1, 1, -1])
    np.testing.assert_allclose(_aggregate("signsgd:vote=false", xs), [1 / 3, 1 / 3, -1, 1 / 3, -1 / 3])
    # the aggregate is a sum over ranks: p times the vote, so Average gives the vote
    np.testing.assert_array_equal(_aggregate("signsgd", xs, average=False), [3, 3, -3, 3, -3])
    # a rank whose tensor is all zero (an unused parameter) does not vote
    zero = [np.array([1, -1, 1], np.float32), np.zeros(3, np.float32)]
    np.testing.assert_array_equal(_aggregate("signsgd", zero), [1, -1, 1])
    np.testing.assert_array_equal(_aggregate("signsgd", [np.zeros(3, np.float32)] * 2), [0, 0, 0])
    # a tie (two ranks that disagree) votes 0, not +1
    two = [np.array([1, -1, 1], np.float32), np.array([-1, 1, 1], np.float32)]
    np.testing.assert_array_equal(_aggregate("signsgd", two), [0, 0, 1])


def test_signum_sends_the_sign_of_its_momentum():
    comp = build("signum:momentum=0.5,vote=false")
    g1 = np.array([1.0, -1.0, 0.2], np.float32)
    g2 = np.array([-0.5, -0.5, -0.3], np.float32)
    out1, _ = single_rank(comp, g1, "w")
    np.testing.assert_array_equal(out1, [1, -1, 1])
    np.testing.assert_allclose(comp.states["w"]["momentum"], 0.5 * g1)  # m starts at 0
    out2, _ = single_rank(comp, g2, "w")
    m = 0.5 * (0.5 * g1) + 0.5 * g2  # [0, -0.5, -0.1]: 0 counts as positive
    np.testing.assert_allclose(comp.states["w"]["momentum"], m)
    np.testing.assert_array_equal(out2, [1, -1, -1])
    # the momentum is checkpointed
    again = build("signum:momentum=0.5,vote=false")
    again.load_state_dict(comp.state_dict())
    g3 = np.array([0.1, 0.9, 0.05], np.float32)
    np.testing.assert_array_equal(single_rank(again, g3, "w")[0], single_rank(comp, g3, "w")[0])


def test_efsignsgd_scales_by_the_mean_magnitude_and_keeps_the_rest():
    comp = build("efsignsgd")
    x = np.array([1, -2, 3, -4], np.float32)
    out, enc = single_rank(comp, x, "w")
    assert enc.payload.tobytes() == _f32(2.5) + bytes([0b0101])
    np.testing.assert_array_equal(out, [2.5, -2.5, 2.5, -2.5])
    np.testing.assert_array_equal(comp.states["w"]["residual"], [-1.5, 0.5, 0.5, -1.5])
    out2, _ = single_rank(comp, np.zeros(4, np.float32), "w")  # the residual alone is sent
    np.testing.assert_array_equal(out2, [-1.0, 1.0, 1.0, -1.0])


def test_natural_rounds_the_exponent_up_with_the_mantissas_probability():
    x = np.array([1.5, -0.75, 0.0, 3.0, 1.0], np.float32)
    noise = np.array([0.4, 0.6, 0.1, 0.9, 0.0], np.float32)
    comp = build("natural")
    out, enc = single_rank(comp, x, noise=noise)
    # 1.5 = 2^0 * 1.5: up (0.4 < 0.5) to 2; -0.75: down (0.6 >= 0.5) to -0.5; 3: down to 2;
    # a power of two stays (probability 0)
    np.testing.assert_array_equal(out, [2.0, -0.5, 0.0, 2.0, 1.0])
    assert enc.payload.tobytes() == bytes([128, 126, 0, 128, 127]) + bytes([0b00010])
    assert enc.nbytes == 5 + 1  # 9 bits per value


def test_natural_subnormals_round_to_zero_or_the_smallest_normal():
    tiny = np.float32(2.0 ** -128)  # a quarter of 2^-126
    comp = build("natural")
    out, _ = single_rank(comp, np.array([tiny, -tiny], np.float32),
                         noise=np.array([0.2, 0.3], np.float32))
    np.testing.assert_array_equal(out, [2.0 ** -126, 0.0])


def test_uniform_levels_per_bucket():
    comp = build("uniform:bits=2,bucket=4,stochastic=false")
    x = np.array([0, 1, 2, 3, 10, 10, 10], np.float32)
    out, enc = single_rank(comp, x)
    np.testing.assert_array_equal(out, x)  # every value is on a level here
    assert enc.payload.tobytes() == (_f32(0) + _f32(10) + _f32(1) + _f32(0)
                                     + bytes([0 | 1 << 2 | 2 << 4 | 3 << 6, 0]))
    assert enc.nbytes == 2 * 8 + 2
    y = np.array([0.0, 0.4, 0.6, 3.0], np.float32)  # nearest level: 0, 0, 1, 3
    np.testing.assert_array_equal(single_rank(comp, y)[0], [0, 0, 1, 3])
    sto = build("uniform:bits=2,bucket=4")
    got = single_rank(sto, y, noise=np.array([0.9, 0.5, 0.5, 0.0], np.float32))[0]
    np.testing.assert_array_equal(got, [0, 0, 1, 3])  # floor(x + u): 0.9, 0.9, 1.1, 3
    got = single_rank(sto, y, noise=np.array([0.0, 0.7, 0.3, 0.0], np.float32))[0]
    np.testing.assert_array_equal(got, [0, 1, 0, 3])


def test_dynamic_tree_levels_are_dettmers_type():
    t = dynamic_tree_levels()
    assert t.shape == (256,) and t.dtype == np.float32 and np.all(np.diff(t) > 0)
    assert t[127] == 0.0 and t[255] == 1.0
    np.testing.assert_array_equal(t[:127], -t[128:255][::-1])  # symmetric but for +1
    pos = t[128:255].astype(np.float64)
    # 2^i linear levels in decade 10^(i-6): 1, 2, 4, ..., 64
    counts = [int(np.sum((pos >= 0.1 * 10.0 ** (i - 6)) & (pos < 10.0 ** (i - 6)))) for i in range(7)]
    assert counts == [1, 2, 4, 8, 16, 32, 64]
    assert math.isclose(pos[0], 0.55e-6, rel_tol=1e-6)  # the midpoint of [0.1, 1] * 1e-6
    assert math.isclose(pos[-1], 0.99296875, rel_tol=1e-6)


def test_eightbit_rounds_to_the_nearest_level_of_the_scaled_value():
    t = dynamic_tree_levels()
    comp = build("eightbit")
    x = np.array([2.0, -1.0, 0.0, 1e-8, 0.3], np.float32)
    out, enc = single_rank(comp, x)
    codes = np.frombuffer(enc.payload.tobytes()[4:], np.uint8)
    assert enc.payload.tobytes()[:4] == _f32(2.0) and enc.nbytes == 4 + 5
    r = x / 2.0
    expect = [int(np.argmin(np.abs(t.astype(np.float64) - v))) for v in r]
    np.testing.assert_array_equal(codes, expect)
    assert codes[0] == 255 and codes[2] == 127 and codes[3] == 127  # 1, 0, 0
    np.testing.assert_array_equal(out, t[codes] * np.float32(2.0))
    rel = np.abs(out[[0, 1, 4]] - x[[0, 1, 4]]) / np.abs(x[[0, 1, 4]])
    assert np.all(rel < 0.02)


EXTREMES = {"subnormal": [1e-40, 2e-40, 3e-40, -1e-40], "just normal": [1e-38, 1.1e-38, 1.5e-38, 2e-38],
            "one subnormal": [1e-45, 0.0, 0.0, 0.0], "both huge": [3e38, -3e38, 1.0, 0.0],
            "wide": [1e38, -1e38, 1.0, 0.0]}


@pytest.mark.parametrize("kind", EXTREMES)
@pytest.mark.parametrize("spec", ["uniform:bucket=4", "uniform:bucket=4,stochastic=false",
                                  "uniform:bits=1,bucket=4", "eightbit"])
def test_level_codecs_stay_finite_and_close_on_extreme_ranges(spec, kind):
    """A range too narrow for ``L / range`` in float32 (subnormals), or wider than
    float32 (values of +-3e38): the scales stay finite, the decoded values too, within
    a step of ``max(range, L * 2^-126) / L`` (uniform), or 1% of ``max(max|v|, 2^-126)``
    (8-bit); a range beyond float32's is clipped at ``lo + 2^128 (1 - 2^-20)``."""
    x = np.array(EXTREMES[kind], np.float32)
    comp = build(spec)
    with np.errstate(over="ignore", under="ignore"):
        out, enc = single_rank(comp, x, noise=np.full(4, 0.5, np.float32))
    assert np.isfinite(out).all()
    err = np.abs(out.astype(np.float64) - x)
    if spec == "eightbit":
        assert err.max() <= 0.01 * max(float(np.abs(x).max()), 2.0 ** -126)
        return
    L = float(comp.codec.levels)
    rng = float(x.max()) - float(x.min())
    if rng > 3.4e38:  # clipped: the top values decode to lo + 3.4e38
        assert float(out.max()) <= float(x.min()) + 2.0 ** 128
        return
    assert err.max() <= max(rng, L * 2.0 ** -126) / L * (1 + 1e-6)


@pytest.mark.parametrize("spec", ["uniform:bucket=4", "uniform:bits=2,bucket=4"])
@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_uniform_stays_unbiased_on_a_subnormal_range(spec):
    """A subnormal bucket is quantized on steps of 2^-126: still unbiased."""
    x = np.array(EXTREMES["subnormal"], np.float32)
    rng = np.random.default_rng(4)
    comp = build(spec)
    with np.errstate(under="ignore"):
        draws = np.array([single_rank(comp, x, noise=rng.random(4, dtype=np.float32))[0]
                          for _ in range(4000)], np.float64)
    sd = draws.std(axis=0) / math.sqrt(len(draws))
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * sd + 1e-46)


def test_sketchml_cuts_quantile_buckets_and_sends_their_means():
    comp = build("sketchml:buckets=4")
    x = np.array([8, 1, 7, 2, 6, 3, 5, 4], np.float32)
    out, enc = single_rank(comp, x)
    # sorted 1..8, edges at ranks 2, 4, 6: 3, 5, 7; a value's bucket: edges <= it
    np.testing.assert_array_equal(comp.codec.edges(comp.B, x), [3, 5, 7])
    assert enc.payload.tobytes() == (b"".join(_f32(m) for m in (1.5, 3.5, 5.5, 7.5))
                                     + bytes([3, 0, 3, 0, 2, 1, 2, 1]))
    np.testing.assert_array_equal(out, [7.5, 1.5, 7.5, 1.5, 5.5, 3.5, 5.5, 3.5])
    # 300 buckets: 16-bit codes; a sample of 4 for the quantiles of 1000 values
    big = build("sketchml:buckets=300,sample=4")
    y = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(big.codec.edges(big.B, y)[:3], [0, 0, 0])  # ranks 0
    assert big.codec.edges(big.B, y)[-1] == 750.0  # sample 0, 250, 500, 750; rank 3
    assert single_rank(big, y)[1].nbytes == 4 * 300 + 2 * 1000
    # a constant tensor: one bucket, decoded exactly
    np.testing.assert_array_equal(single_rank(comp, np.full(10, 0.25, np.float32))[0], 0.25)


def _i32(*vals):
    return b"".join(struct.pack("<i", v) for v in vals)


def test_thresholdv_sends_what_exceeds_tau_with_its_index():
    comp = build("thresholdv:tau=0.5")
    x = np.array([0.4, -0.6, 0.5, 2.0], np.float32)
    out, enc = single_rank(comp, x, "w")
    assert enc.payload.tobytes() == _f32(1.0) + _f32(-0.6) + _f32(2.0) + _i32(1, 3)
    assert enc.nbytes == 4 + 8 * 2
    np.testing.assert_array_equal(out, np.array([0, -0.6, 0, 2.0], np.float32))
    np.testing.assert_array_equal(comp.states["w"]["residual"], np.array([0.4, 0, 0.5, 0], np.float32))
    # nothing above tau: the flag alone; the residual grows until it passes
    out, enc = single_rank(comp, np.array([0.05, 0, 0.05, 0], np.float32), "w")
    np.testing.assert_allclose(out, [0, 0, 0.55, 0])  # 0.5 + 0.05 > 0.5: sent
    assert enc.nbytes == 4 + 8 * 1
    assert comp.payload_nbytes(comp.meta_for(x)) == 4 + 8 * 4  # the most it can take


def test_adaq_sends_the_largest_of_each_sign_as_one_mean():
    comp = build("adaq:ratio=0.5")
    x = np.array([3, -1, 2, -4, 1, 0], np.float32)
    out, enc = single_rank(comp, x, "w")
    # k+ = ceil(0.5 * 3) = 2: 3 and 2, mean 2.5; k- = ceil(0.5 * 2) = 1: -4
    assert enc.payload.tobytes() == _f32(1.0) + _f32(2.5) + _f32(-4.0) + _i32(2) + _i32(0, 2, 3)
    assert enc.nbytes == 16 + 4 * 3
    np.testing.assert_array_equal(out, [2.5, 0, 2.5, -4, 0, 0])
    np.testing.assert_array_equal(comp.states["w"]["residual"], [0.5, -1, -0.5, 0, 1, 0])
    zeros, enc = single_rank(build("adaq"), np.zeros(5, np.float32))
    assert enc.nbytes == 16 and not zeros.any()


def test_variable_sizes_differ_by_rank_and_aggregate_in_rank_order():
    """Three ranks with different numbers of values above tau: the rows differ in length
    and the sum is every rank's decoded payload."""
    xs = [np.array([1, 0, 0, 0], np.float32), np.array([1, 1, 1, 0], np.float32),
          np.zeros(4, np.float32)]
    comps = [build("thresholdv:tau=0.5", rank=r, world_size=3) for r in range(3)]
    encs = [c.encode(x, "w") for c, x in zip(comps, xs)]
    assert [e.nbytes for e in encs] == [12, 28, 4]
    np.testing.assert_array_equal(comps[0].aggregate([e.payload for e in encs], encs[0]), [2, 1, 1, 0])


def test_inceptionn_sends_each_value_in_the_fewest_bits_within_the_bound():
    comp = build("inceptionn:bound=0.5")  # grid s = 2 * 0.5 * (1 - 2^-7)
    s = 1.0 - 2.0 ** -7
    x = np.array([0.3, -2.0, 100.0, -5000.0, 1e6, 0.0], np.float32)
    out, enc = single_rank(comp, x)
    # q = round(x / s): 0 (0 bits), -2 and 101 (8 bits), -5039 (16 bits), 1e6 (float32)
    q = [0, -2, 101, -5039]
    assert enc.payload.tobytes() == (_f32(1.0) + _i32(1, 1) + _f32(1e6)
                                     + struct.pack("<h", -5039) + bytes([126, 229])
                                     + bytes([0 | 1 << 2 | 1 << 4 | 2 << 6, 3]))  # widths, 2 bits each
    assert enc.nbytes == 12 + 4 + 2 + 2 + 2
    expect = np.array([0, q[1] * s, q[2] * s, q[3] * s, 1e6, 0], np.float32)
    np.testing.assert_array_equal(out, expect)
    assert np.max(np.abs(out.astype(np.float64) - x)) <= 0.5


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1e-1, 10.0, 1e4, 1e30])
@pytest.mark.parametrize("bound", [2.0 ** -10, 1e-6, 0.3])
def test_inceptionn_error_bound_holds_everywhere(scale, bound):
    rng = np.random.default_rng(int(scale * 1e6) % 1000 + int(bound * 1e6))
    x = (rng.standard_normal(20000) * scale).astype(np.float32)
    x[:6] = [bound, -bound, 0.5 * bound, 127.5 * 2 * bound, 32767.4 * 2 * bound, np.float32(3e38)]
    out, enc = single_rank(build(f"inceptionn:bound={bound!r}"), x)
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    assert np.max(err) <= bound, (scale, bound, np.max(err))
    assert enc.nbytes <= build("inceptionn").payload_nbytes(build("inceptionn").meta_for(x))


# -- statistical properties --------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["natural", "uniform:bits=2,bucket=16", "uniform:bits=4",
                                  "topk:ratio=0.5,ef=false+natural"])
@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_stochastic_level_codecs_are_unbiased(spec):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(40).astype(np.float32)
    if "natural" in spec:  # subnormals, huge, zero (in a max-min bucket, a huge value
        # would leave the others a probability below the noise's 2^-24 resolution)
        x[:4] = [2.0 ** -130, -3e-39, 1e30, 0.0]
    comp = build(spec)
    k = comp.k_for(comp.meta_for(x)) if comp.spec.composed else x.size
    draws = np.array([single_rank(comp, x, "w", noise=rng.random(k, dtype=np.float32))[0]
                      for _ in range(3000)], np.float64)
    target = x.astype(np.float64)
    if comp.spec.composed:  # unbiased for the values top-k keeps
        target = np.where(np.abs(x) >= np.sort(np.abs(x))[-k], target, 0.0)
    sd = draws.std(axis=0)
    z = np.abs(draws.mean(axis=0) - target) / (sd / math.sqrt(len(draws)) + 1e-300)
    assert np.all((z < 5.0) | (np.abs(draws.mean(axis=0) - target) <= 1e-6 * np.abs(target))), spec


@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_natural_variance_within_the_papers_bound():
    """omega = 1/8: E|C(x) - x|^2 <= |x|^2 / 8."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(200).astype(np.float32)
    comp = build("natural")
    draws = np.array([single_rank(comp, x, noise=rng.random(200, dtype=np.float32))[0]
                      for _ in range(500)], np.float64)
    var = np.mean(np.sum((draws - x) ** 2, axis=1))
    assert var <= 1.05 * float(np.sum(x.astype(np.float64) ** 2)) / 8


@pytest.mark.parametrize("spec", ["efsignsgd", "eightbit:ef=true", "uniform:bits=1,ef=true,stochastic=false",
                                  "thresholdv:tau=0.5", "adaq:ratio=0.1", "inceptionn:ef=true"])
def test_multi_rank_error_feedback_loses_nothing(spec):
    """Over steps and three ranks: the averaged results plus the ranks' mean residual
    equal the mean of everything the ranks put in."""
    rng = np.random.default_rng(5)
    comps = [build(spec, rank=r, world_size=3) for r in range(3)]
    put, got = np.zeros(60), np.zeros(60)
    for _ in range(10):
        xs = [rng.standard_normal(60).astype(np.float32) for _ in comps]
        encs = [c.encode(x, "w") for c, x in zip(comps, xs)]
        got += comps[0].aggregate([e.payload for e in encs], encs[0]) / 3
        put += sum(x.astype(np.float64) for x in xs) / 3
    residual = sum(c.states["w"]["residual"].astype(np.float64) for c in comps) / 3
    np.testing.assert_allclose(got + residual, put, atol=1e-4)


def test_engine_average_of_a_vote_over_two_loopback_steps():
    comp = build("signum")
    engine = Exchange(comp, Loopback(), average=True)
    out = engine.run([np.array([0.3, -0.2], np.float32)], ["w"], new_stats())[0]
    np.testing.assert_array_equal(out, [1, -1])  # one rank: its own sign


# -- specs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["adaq", "inceptionn"])
def test_int32_counts_refuse_tensors_they_cannot_count(spec):
    """adaq's k+ and INCEPTIONN's width counts are int32: a tensor of 2^31 or more
    elements is refused with a clear error (a broadcast view: no memory is used)."""
    x = np.broadcast_to(np.float32(1.0), (2 ** 31,))
    with pytest.raises(ValueError, match="int32 counts"):
        build(spec).meta_for(x, "huge")
    build(spec).meta_for(x[:2 ** 31 - 1], "fits")


def test_specs_validate_their_parameters():
    assert specmod.parse("uniform").parts[0].params == {"bits": 4, "bucket": 512, "stochastic": True,
                                                        "ef": False, "seed": 0}
    assert specmod.parse("signum").parts[0].params["momentum"] == 0.9
    assert specmod.parse("efsignsgd").parts[0].params["ef"] is True
    for bad in ["uniform:bits=9", "uniform:bits=0", "uniform:bucket=0", "signum:momentum=1",
                "signsgd:ef=true", "topk+signsgd", "natural:levels=3", "sketchml:buckets=1",
                "sketchml:buckets=40000", "sketchml:sample=1", "thresholdv:tau=0", "adaq:ratio=0",
                "topk+thresholdv", "topk+adaq", "inceptionn:bound=0", "topk+inceptionn"]:
        with pytest.raises(ValueError):
            specmod.parse(bad)
    assert specmod.parse("topk:ratio=0.1+uniform:bits=2").composed


@pytest.mark.parametrize("name", NEW)
def test_framework_classes_exist_for_every_new_method(name):
    import hvd_compress.tensorflow as hct
    import hvd_compress.torch as hc
    alg = registry.get(name)
    assert getattr(hc, alg.class_name)().core.name == name
    assert getattr(hct, alg.class_name)().core.name == name
