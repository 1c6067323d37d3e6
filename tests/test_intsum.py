"""Quantizers summed as integers (``sum=int``): the aggregate against an independent numpy
model of each method, lanes that cannot overflow, unbiasedness, the same bits in PyTorch
and TensorFlow, and the bytes that no longer grow with the number of workers."""

import threading

import numpy as np
import pytest

from hvd_compress.core import Exchange, build, new_stats
from hvd_compress.core.exchange import MAX
from hvd_compress.core.intsum import LANE_BITS, lane_bits
from tests.test_exchange_engine import Table

SPECS = ["terngrad:sum=int", "terngrad:sum=int,clip=0", "qsgd:sum=int", "qsgd:sum=int,levels=2,bucket=16",
         "signsgd:sum=int", "signsgd:sum=int,vote=false", "terngrad:sum=int,ef=true",
         "qsgd:sum=int,ef=true,bucket=8"]
SHAPES = {"a.weight": (6, 5), "a.bias": (5,), "b.weight": (4, 3, 2), "odd": (37,)}


def _grads(rank, step):
    rng = np.random.default_rng([rank, step, 7])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    out[0][0, :3] = 0.0  # zeros: signSGD's 0 votes 0
    out[3][5:] = out[3][5:] * 1e-3
    return out


def _noises(rank, step):
    rng = np.random.default_rng([rank, step, 11])
    return [rng.random(int(np.prod(s)), dtype=np.float32) for s in SHAPES.values()]


# -- an independent model of each method's integer codes --------------------------------------
def _model_codes(kind, params, xs, us):
    """Each rank's integer codes (int64) and the unit a code is worth, per value."""
    n = xs[0].size
    if kind == "signsgd":
        return [np.sign(x).astype(np.int64) for x in xs], None
    if kind == "terngrad":
        mags = []
        for x in xs:
            m = np.abs(x)
            if params["clip"] > 0:
                x64 = x.astype(np.float64)
                mean = x64.sum() / n
                sigma = np.float32(np.sqrt(max((x64 * x64).sum() / n - mean * mean, 0.0)))
                m = np.minimum(m, np.float32(params["clip"]) * sigma)
            mags.append(m)
        scale = max(np.float32(m.max()) for m in mags)
        div = scale if scale > 0 else np.float32(1)
        codes = [np.sign(x).astype(np.int64) * (u < m / div) for x, m, u in zip(xs, mags, us)]
        return codes, np.full(n, scale, np.float32)
    s, d = params["levels"], params["bucket"]
    nb = -(-n // d)
    norms = np.max([[np.float32(np.sqrt(np.sum(x[b * d:(b + 1) * d].astype(np.float64) ** 2)))
                     for b in range(nb)] for x in xs], axis=0).astype(np.float32)
    inv = np.where(norms > 0, np.float32(s) / np.where(norms > 0, norms, 1), 0).astype(np.float32)
    per = np.repeat(inv, d)[:n]
    codes = [np.sign(x).astype(np.int64) * np.minimum(np.floor(np.abs(x) * per + u), s).astype(np.int64)
             for x, u in zip(xs, us)]
    return codes, np.repeat(norms / np.float32(s), d)[:n]


def _run_engine(spec, size, steps=3, world_size=None):
    """Every rank's results of batched exchanges on simulated ranks (the engine, numpy)."""
    table = Table(size)
    comps = [build(spec, rank=r, world_size=world_size or size) for r in range(size)]
    engines = [Exchange(comps[r], table.rank(r), average=False) for r in range(size)]
    out = []
    for step in range(steps):
        stats = [new_stats() for _ in range(size)]
        results = [None] * size

        def rank(r):
            b = engines[r].send(_grads(r, step), list(SHAPES), stats[r], tag=f".{step}",
                                noises=_noises(r, step))
            results[r] = engines[r].receive(b, stats[r])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out.append((results, stats))
    return out, comps, table


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("size,world_size", [(2, None), (3, None), (3, 200), (2, 5000)])
def test_the_sum_is_the_models_integer_codes_times_their_unit_bit_for_bit(spec, size, world_size):
    comp = build(spec, world_size=world_size or size)
    kind, params = comp.kind, comp.params
    runs, comps, table = _run_engine(spec, size, world_size=world_size)
    residuals = [dict() for _ in range(size)]
    for step, (results, stats) in enumerate(runs):
        for r in range(1, size):  # every rank holds the same aggregate
            for a, b in zip(results[0], results[r]):
                np.testing.assert_array_equal(a, b)
        for i, name in enumerate(SHAPES):
            xs = [_grads(r, step)[i].reshape(-1) for r in range(size)]
            if params.get("ef"):
                xs = [x + residuals[r].get(name, 0) for r, x in enumerate(xs)]
            us = [_noises(r, step)[i] for r in range(size)]
            codes, unit = _model_codes(kind, params, xs, us)
            total = sum(codes)
            assert np.abs(total).max() <= size * comp.m
            if kind == "signsgd":
                want = np.sign(total) if params["vote"] else total
                want = want.astype(np.float32)
            else:
                want = total.astype(np.float32) * unit
            np.testing.assert_array_equal(results[0][i].reshape(-1), want, err_msg=f"{name} {step}")
            if params.get("ef"):  # what was not sent stays behind, per rank
                for r in range(size):
                    residuals[r][name] = xs[r] - codes[r].astype(np.float32) * unit
        # one max round and one sum round for the whole batch; bytes: both rounds
        want_bytes = sum(comp.payload_nbytes(comp.meta_for(np.zeros(s, np.float32), n))
                         for n, s in SHAPES.items())
        assert [s["bytes_sent"] for s in stats] == [want_bytes] * size
        assert [s["collectives"] for s in stats] == [2] * size
    for r in range(size):  # the residuals the last step left
        for name, residual in residuals[r].items():
            np.testing.assert_allclose(comps[r].states[name]["residual"], residual, rtol=1e-6,
                                       atol=1e-6)
    assert {op for _, _, op in table.ops} == {MAX, None}


def test_bytes_per_worker_are_the_same_at_two_and_four_workers():
    for spec, scales in [("terngrad:sum=int", 1), ("signsgd:sum=int", 1), ("qsgd:sum=int,levels=1", 2)]:
        sizes = {p: build(spec, world_size=p).payload_nbytes(build(spec).meta_for(np.zeros(1000, np.float32)))
                 for p in (2, 4, 7)}
        assert len(set(sizes.values())) == 1, (spec, sizes)
        assert sizes[2] == 4 * scales + 1000 * 4 // 8  # the scales, and 4-bit lanes
    flat = build("terngrad").payload_nbytes(build("terngrad").meta_for(np.zeros(1000, np.float32)))
    assert flat == 4 + 250  # what each rank's allgather row is (received p - 1 times)


@pytest.mark.parametrize("w", LANE_BITS)
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("sign", [1, -1])
def test_lanes_hold_the_worst_case_at_the_largest_world_size_they_allow(w, m, sign):
    """Every rank sends the largest code (+m or -m) in every lane, at the most ranks the
    lane width is chosen for; int32 words add modulo 2**32 (numpy's int32 sum wraps as
    Horovod's does: test_horovod_int32_sums_wrap checks the real collectives)."""
    most = ((1 << (w - 1)) - 1) // m
    if w < 32:
        assert lane_bits(most + 1, m) > w  # one more rank needs a wider lane
    assert lane_bits(most, m) == w or lane_bits(most, m) < w
    comp = build("qsgd:sum=int,levels=%d" % m if m > 1 else "terngrad:sum=int", world_size=most)
    comp.w = w  # (the narrowest for `most` may be narrower when m divides oddly)
    n = 2 * (32 // w) + 3  # whole words and a part word
    level = np.full(n, m, np.uint8)
    neg = np.full(n, sign < 0, np.uint8)
    words = comp._pack(level, neg, n)
    if w == 32:  # 2**31 - 1 ranks cannot be stacked: the sum is the product, modulo 2**32
        total = (words.astype(np.int64) * most).astype(np.int32)
    else:
        total = np.sum(np.stack([words] * most), axis=0, dtype=np.int32)
    lanes = comp.lanes(total, n)
    np.testing.assert_array_equal(lanes, np.full(n, sign * most * m, np.float32))


def test_the_engine_refuses_more_ranks_than_the_lanes_hold():
    """Built for fewer ranks than take part: its lanes could overflow, so no exchange."""
    cases = [("terngrad:sum=int", 2, 8),       # 4-bit lanes hold 7 ranks' sums
             ("qsgd:sum=int,levels=7", 1, 3)]  # 4-bit lanes hold one rank's codes of 7
    for spec, built_for, size in cases:
        comp = build(spec, world_size=built_for)
        assert comp.max_ranks < size
        with pytest.raises(ValueError, match="hold at most"):
            Exchange(comp, Table(size).rank(0)).send([np.ones(4, np.float32)], ["w"], new_stats())


@pytest.mark.parametrize("spec", ["terngrad:sum=int,clip=0", "qsgd:sum=int,levels=2,bucket=8"])
@pytest.mark.usefixtures("one_numba_thread")  # milliseconds a call saved (tests/conftest.py)
def test_unbiased_where_the_original_is(spec):
    """The mean over many draws of the aggregate of 3 ranks approaches the sum of their
    values within 5 standard errors (signSGD is not unbiased, nor meant to be)."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(48).astype(np.float32) for _ in range(3)]
    trials = 3000
    comps = [build(spec, rank=r, world_size=3) for r in range(3)]
    acc, acc2 = np.zeros(48), np.zeros(48)
    for t in range(trials):
        encs = [c.encode(x, "w") for c, x in zip(comps, xs)]
        shared = np.maximum.reduce([e.payload for e in encs])
        encs = [c.next_round(e, shared) for c, e in zip(comps, encs)]
        words = np.sum(np.stack([e.payload for e in encs]), axis=0, dtype=np.int32)
        agg = comps[0].aggregate(words, encs[0]).astype(np.float64)
        acc += agg
        acc2 += agg * agg
    mean = acc / trials
    se = np.sqrt(np.maximum(acc2 / trials - mean ** 2, 0) / trials)
    want = sum(xs)
    assert np.all(np.abs(mean - want) <= 5 * se + 1e-6), np.max(np.abs(mean - want) / (se + 1e-12))
    assert se.max() > 0  # it did vary


def test_a_non_finite_rank_makes_every_rank_nan_and_keeps_every_state():
    comps = [build("terngrad:sum=int,ef=true", rank=r, world_size=2) for r in range(2)]
    xs = [np.ones(10, np.float32), np.ones(10, np.float32)]
    for c, x in zip(comps, xs):  # a first finite step leaves residuals
        c.encode(x, "w")
    encs = [c.encode(x, "w") for c, x in zip(comps, xs)]
    shared = np.maximum.reduce([e.payload for e in encs])
    encs = [c.next_round(e, shared) for c, e in zip(comps, encs)]
    before = [c.states["w"]["residual"].copy() for c in comps]
    bad = xs[1].copy()
    bad[3] = np.inf
    encs = [comps[0].encode(xs[0], "w"), comps[1].encode(bad, "w")]
    shared = np.maximum.reduce([e.payload for e in encs])
    assert np.isinf(shared).all()
    encs = [c.next_round(e, shared) for c, e in zip(comps, encs)]
    words = encs[0].payload + encs[1].payload
    for c, e, b in zip(comps, encs, before):
        assert np.isnan(c.aggregate(words, e)).all()
        np.testing.assert_array_equal(c.states["w"]["residual"], b)


def test_specs_choose_and_refuse():
    assert type(build("terngrad:sum=int")).__name__ == "IntegerSum"
    assert type(build("terngrad")).__name__ == "QuantizerCompressor"
    assert build("qsgd:sum=int").summable and build("qsgd:sum=int").integer_sum
    with pytest.raises(ValueError, match="sum must be gather or int"):
        build("terngrad:sum=float")
    with pytest.raises(ValueError, match="composition gathers"):
        build("topk:ratio=0.1+terngrad:sum=int")
    with pytest.raises(ValueError, match="unknown parameter 'sum'"):
        build("onebit:sum=int")
    with pytest.raises(ValueError, match="cannot hold"):
        lane_bits(2 ** 31, 1)
    with pytest.raises(TypeError, match="floating point"):
        build("terngrad:sum=int").encode(np.ones(3, np.int32), "w")
    with pytest.raises(ValueError, match="empty"):
        build("terngrad:sum=int").encode(np.ones(0, np.float32), "w")


# -- the same bits in PyTorch and TensorFlow -------------------------------------------------
def _simulated(spec, B, xs, us, world_size):
    """Aggregates (rank 0's, as numpy) and final payloads of ranks sending ``xs`` on backend ``B``."""
    comps = [build(spec, B, rank=r, world_size=world_size) for r in range(len(xs))]
    out = []
    for step in range(len(xs[0])):
        encs = [c.encode(B.from_numpy(x[step]), "w", noise=B.from_numpy(u[step]))
                for c, x, u in zip(comps, xs, us)]
        shared = np.maximum.reduce([B.to_numpy(e.payload) for e in encs])
        encs = [c.next_round(e, B.from_numpy(shared)) for c, e in zip(comps, encs)]
        words = np.sum(np.stack([B.to_numpy(e.payload) for e in encs]), axis=0, dtype=np.int32)
        agg = comps[0].aggregate(B.from_numpy(words), encs[0])
        out.append((B.to_numpy(agg), [B.to_numpy(e.payload) for e in encs]))
    return out


@pytest.mark.parametrize("backend", ["torch", "torch-device-path", "tensorflow"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world_size", [2, 30, 5000])  # lanes of 4, 8, 16 (QSGD: 8, 16, 32) bits
def test_frameworks_send_and_sum_the_same_bits_as_numpy(backend, spec, world_size):
    from hvd_compress.core import NUMPY
    if backend == "tensorflow":
        from hvd_compress.tensorflow.backend import TensorFlowBackend
        B = TensorFlowBackend()
    else:
        from tests.test_torch_same_bits import BACKENDS
        B = BACKENDS["host" if backend == "torch" else "device-path"]
    rng = np.random.default_rng(5)
    shape = (3, 70) if world_size < 1000 else (1001,)
    xs = [[(rng.standard_normal(shape) * 1e-2).astype(np.float32) for _ in range(3)] for _ in range(2)]
    us = [[rng.random(int(np.prod(shape)), dtype=np.float32) for _ in range(3)] for _ in range(2)]
    want = _simulated(spec, NUMPY, xs, us, world_size)
    got = _simulated(spec, B, xs, us, world_size)
    for (a, pa), (b, pb) in zip(want, got):
        for x, y in zip(pa, pb):
            assert x.tobytes() == y.tobytes()
        np.testing.assert_array_equal(b.reshape(a.shape), a)


def test_horovods_own_wrappers_are_refused_with_ours_named():
    import torch

    import hvd_compress.torch as hc
    with pytest.raises(RuntimeError, match="would truncate.*hvd_compress.torch.DistributedOptimizer"):
        hc.compressor("terngrad:sum=int").compress(torch.ones(4))


def test_the_cost_model_widens_the_lanes_with_the_worker_count():
    from hvd_compress.tools import costmodel
    prof = costmodel.Profile("terngrad:sum=int", costmodel.ALLREDUCE, 10.0, 1.0, 1.0, nbytes=1000.0,
                             messages=2.0, measured_p=2, lane_m=1)
    assert [prof.nbytes_at(p) for p in (2, 7, 8, 127, 128, 1024)] == [1000, 1000, 2000, 2000, 4000, 4000]
    flat = costmodel.Profile("terngrad", costmodel.ALLGATHER, 10.0, 1.0, 1.0, nbytes=500.0, measured_p=2)
    assert flat.nbytes_at(1024) == 500.0
    # on the wire: the integer sum's bytes stay near 2 x its payload, the allgather's grow
    wire = {p: (costmodel.wire_bytes(costmodel.ALLREDUCE, p, prof.nbytes_at(p)),
                costmodel.wire_bytes(costmodel.ALLGATHER, p, flat.nbytes_at(p))) for p in (2, 64, 1024)}
    assert wire[2][0] == 1000 and wire[1024][0] < 8000 and wire[1024][1] == 1023 * 500


@pytest.mark.parametrize("spec", ["terngrad:sum=int,ef=true", "qsgd:sum=int,ef=true,bucket=8"])
def test_a_batch_of_equal_sizes_keeps_each_tensors_noise_in_torch(spec):
    """The engine encodes a batch's tensors (round 0) before it codes any of them (round 1).
    Torch's host generator hands out one buffer for every draw: noise drawn at round 0 would
    be the last tensor's by round 1.  Each tensor must be coded as if it went alone."""
    pytest.importorskip("torch")
    from tests.test_torch_same_bits import BACKENDS
    B = BACKENDS["host"]
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(40).astype(np.float32) for _ in range(3)]
    shared = [np.array([4.0], np.float32) if "terngrad" in spec else np.full(5, 9.0, np.float32)] * 3

    def words(interleaved):
        comp = build(spec, B, rank=0, world_size=2)
        if interleaved:  # as the engine: every round 0, then every round 1
            encs = [comp.encode(B.from_numpy(x), f"t{i}") for i, x in enumerate(xs)]
            return [B.to_numpy(comp.next_round(e, B.from_numpy(s)).payload) for e, s in zip(encs, shared)]
        return [B.to_numpy(comp.next_round(comp.encode(B.from_numpy(x), f"t{i}"), B.from_numpy(s)).payload)
                for i, (x, s) in enumerate(zip(xs, shared))]

    alone, batched = words(False), words(True)
    for a, b in zip(alone, batched):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(alone[0], alone[1])  # (the tensors' codes differ at all)
