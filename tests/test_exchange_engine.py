"""The exchange engine on simulated ranks: several ranks' engines in one process, whose
collectives meet in a shared table (no Horovod), checked against the numpy core."""

import threading

import numpy as np
import pytest

from hvd_compress.core import Collectives, Exchange, Loopback, build, new_stats
from hvd_compress.core.exchange import MAX


class Table(Collectives):
    """``size`` ranks' collectives in one process, one thread per rank: a rank posts its
    payload under the collective's name, and its wait blocks until every rank has."""

    def __init__(self, size):
        self.size = size
        self.posted = {}
        self.ops = []
        self.scales = []  # (name, op, prescale, postscale) of every allreduce, as given
        self.cond = threading.Condition()
        self.sums_bfloat16 = True
        self.timeout = 30  # seconds a wait gives the other ranks

    def rank(self, r):
        table = self

        class View(Collectives):
            size = table.size
            rank = r
            sums_bfloat16 = table.sums_bfloat16

            def _post(self, kind, name, flat, op, post):
                with table.cond:
                    table.posted.setdefault(name, {})[r] = flat if isinstance(flat, list) else np.array(flat)
                    table.ops.append((kind, name, op))
                    table.cond.notify_all()
                return kind, name, post

            def allreduce(self, flat, name, op=None, prescale=1.0, postscale=1.0):
                with table.cond:
                    table.scales.append((name, op, prescale, postscale))
                if op == MAX:
                    return self._post("max", name, flat, op, 1.0)
                post = postscale / (table.size if op == "average" else 1)
                flat = np.array(flat) * prescale if prescale != 1.0 else np.array(flat)
                return self._post("allreduce", name, flat, op, post)

            def allgather(self, flat, name):
                return self._post("allgather", name, flat, None, 1.0)

            def reducescatter(self, flat, name):
                return self._post("reducescatter", name, flat, None, 1.0)

            def alltoall(self, flat, splits, name):
                flat, at, rows = np.array(flat), 0, []
                for k in splits:
                    rows.append(flat[at:at + k])
                    at += k
                assert at == flat.shape[0], (at, flat.shape)
                return self._post("alltoall", name, rows, None, 1.0)

            def wait(self, handle):
                kind, name, post = handle
                with table.cond:
                    if not table.cond.wait_for(lambda: len(table.posted[name]) == table.size,
                                               table.timeout):
                        raise TimeoutError(f"rank {r}: {name} never came from every rank")
                    parts = [table.posted[name][q] for q in range(table.size)]
                if kind == "alltoall":  # what every rank sent to this one, in rank order
                    mine = [parts[q][r] for q in range(table.size)]
                    return np.concatenate(mine), [int(x.shape[0]) for x in mine]
                if kind == "max":
                    return np.maximum.reduce(parts)
                if kind == "reducescatter":  # rank r's part of the sum
                    k = parts[0].shape[0] // table.size
                    return sum(parts)[r * k:(r + 1) * k]
                if kind == "allreduce":  # int32 words add modulo 2**32, as Horovod's do
                    return sum(parts) * post if post != 1.0 else sum(parts)
                return np.concatenate(parts)

        return View()


SHAPES = {"a.weight": (6, 5), "a.bias": (5,), "b.weight": (4, 3, 2)}


def _grads(rank, step=0):
    rng = np.random.default_rng([rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]


def _run(spec, size=3, steps=2, predivide=1.0, average=True, op="average", bf16_sum=True):
    """Every rank's results of ``steps`` batched exchanges, ranks stepping together."""
    table = Table(size)
    table.sums_bfloat16 = bf16_sum
    comps = [build(spec, rank=r, world_size=size) for r in range(size)]
    engines = [Exchange(comps[r], table.rank(r), average=average, predivide=predivide, op=op)
               for r in range(size)]
    out = []
    for step in range(steps):
        stats = [new_stats() for _ in range(size)]
        batches, results = [None] * size, [None] * size

        def rank(r):
            batches[r] = engines[r].send(_grads(r, step), list(SHAPES), stats[r], tag=f".{step}")
            results[r] = engines[r].receive(batches[r], stats[r])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out.append((results, stats, batches))
    return out, comps, table


@pytest.mark.parametrize("spec", ["topk:ratio=0.2", "onebit", "qsgd:levels=7", "none", "fp16",
                                  "randomk:ratio=0.3", "powersgd:rank=1", "dgc:ratio=0.1"])
def test_ranks_agree_and_equal_the_mean_of_decoded_payloads(spec):
    runs, comps, _ = _run(spec)
    for results, stats, batches in runs:
        for r in range(1, len(results)):
            for a, b in zip(results[0], results[r]):
                np.testing.assert_array_equal(a, b)
        for i, (name, shape) in enumerate(SHAPES.items()):
            assert results[0][i].shape == shape
        if spec.startswith("powersgd"):
            continue  # its decode needs both rounds; the multirank tests check it
        for i, name in enumerate(SHAPES):
            encs = [batches[r].encoded[i] for r in range(len(results))]
            ref = sum(comps[r].decode(encs[r].payload, encs[r].meta, encs[r].ctx)
                      for r in range(len(results))) / len(results)
            tol = 2 ** -8 if spec == "fp16" else 1e-6  # fp16 payloads are summed in fp16
            np.testing.assert_allclose(results[0][i], ref, rtol=tol, atol=tol)


def test_batches_keep_order_and_split_by_rounds():
    """PowerSGD sends vectors in one round and matrices in two: one batch becomes two
    collectives per round, and results come back in the order sent."""
    runs, _, table = _run("powersgd:rank=1", steps=1)
    results, stats, batches = runs[0]
    assert len(batches[0].parts) == 2
    assert [r.shape for r in results[0]] == list(SHAPES.values())
    names = {n for _, n, _ in table.ops}
    assert len(names) == 3  # round 0 of each part, round 1 of the matrices
    assert stats[0]["collectives"] == 3


def test_predivide_and_average_match_horovods_arithmetic():
    plain, _, _ = _run("topk:ratio=0.5", steps=1)
    scaled, _, _ = _run("topk:ratio=0.5", steps=1, predivide=4.0)
    summed, _, _ = _run("topk:ratio=0.5", steps=1, average=False)
    for a, b, s in zip(plain[0][0][0], scaled[0][0][0], summed[0][0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(s, 3 * a, rtol=1e-6)


@pytest.mark.parametrize("spec", ["signsgd", "signum", "signsgd:vote=false"])
def test_predivide_leaves_the_majority_vote_as_it_is(spec):
    """gradient_predivide_factor f divides the inputs by f and multiplies the average by
    f; signs do not scale with their inputs, so f must not multiply their vote or mean:
    with f = 4 the result is the one with f = 1 (the vote: each coordinate -1, 0, +1)."""
    plain, _, _ = _run(spec, steps=2)
    scaled, _, _ = _run(spec, steps=2, predivide=4.0)
    for step in range(2):
        for a, b in zip(plain[step][0][0], scaled[step][0][0]):
            np.testing.assert_array_equal(a, b)
            if "vote=false" not in spec:
                assert set(np.unique(a)) <= {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("spec", ["signsgd", "signum"])
def test_predivide_leaves_the_tensorflow_vote_as_it_is(spec):
    """The same through TensorFlow's compressor classes (the engine sees the wrapper)."""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from hvd_compress.tensorflow.compressors import compressor
    x = np.array([0.3, -2.0, 0.0, 5.0], np.float32)
    out = {}
    for f in (1.0, 4.0):
        c = compressor(spec)
        c._rank, c._world_size = 0, 1
        out[f] = Exchange(c, Loopback(), average=True, predivide=f).run([tf.constant(x)], ["w"],
                                                                         new_stats())[0].numpy()
    np.testing.assert_array_equal(out[4.0], out[1.0])
    assert set(np.unique(out[1.0])) <= {-1.0, 0.0, 1.0}


def test_none_is_horovods_own_average():
    """Uncompressed: the collective gets the user's op (here a stand-in for hvd.Average)
    with prescale 1/f and postscale f, and nothing is decoded or scaled afterwards."""
    runs, _, table = _run("none", steps=1, predivide=2.0, op="average")
    assert {op for kind, _, op in table.ops} == {"average"}
    # horovod/torch/optimizer.py (0.28.1): op=Average splits the average into
    # prescale_factor = 1/f and postscale_factor = f (the C++ side adds 1/size)
    assert table.scales and {s[1:] for s in table.scales} == {("average", 0.5, 2.0)}
    results = runs[0][0]
    for i in range(len(SHAPES)):
        mean = sum(_grads(r)[i] for r in range(3)) / 3
        np.testing.assert_allclose(results[0][i], mean, rtol=1e-6)


def test_none_with_sum_leaves_the_scales_at_one():
    """op=Sum (``average=False``): Horovod applies no predivide factor (its wrappers refuse
    f != 1 there); the engine hands the collective 1 and 1 whatever it was given."""
    runs, _, table = _run("none", steps=1, predivide=2.0, average=False, op="sum")
    assert table.scales and {s[1:] for s in table.scales} == {("sum", 1.0, 1.0)}
    for i in range(len(SHAPES)):
        total = sum(_grads(r)[i] for r in range(3))
        np.testing.assert_allclose(runs[0][0][0][i], total, rtol=1e-6)


def _predivided_reference(spec, f, size=3, steps=2, average=True):
    """Per step, the aggregate by the engine's definition with predivide ``f``: every
    rank's compressor encodes ``x / f`` (op=Average), the decoded payloads are summed,
    and the sum is multiplied by ``f / p`` (op=Average) -- numpy, ranks replayed."""
    comps = [build(spec, rank=r, world_size=size) for r in range(size)]
    out = []
    for step in range(steps):
        got = []
        for i, name in enumerate(SHAPES):
            total = 0
            for r, comp in enumerate(comps):
                x = _grads(r, step)[i]
                x = x * np.float32(1.0 / f) if average else x
                enc = comp.encode(x, name)
                total = total + comp.decode(enc.payload, enc.meta, enc.ctx)
            got.append(total * np.float32(f / size) if average else total)
        out.append(got)
    return out


@pytest.mark.parametrize("average", [True, False])
def test_predivide_reaches_a_compressor_whose_output_depends_on_the_scale(average):
    """Threshold quantization sends +tau, -tau or 0 (its residual keeps the rest): it does
    not scale with its input, so dividing by f before encoding changes which values go
    and the aggregate differs from f = 1's.  With op=Average the engine's result is
    sum_r decode(encode(x_r / f)) * f / p; with op=Sum the factor is not applied."""
    spec, f = "threshold:tau=0.5", 4.0
    plain, _, _ = _run(spec, steps=2, average=average)
    scaled, _, _ = _run(spec, steps=2, predivide=f, average=average)
    want = _predivided_reference(spec, f, average=average)
    same = _predivided_reference(spec, 1.0, average=average)
    for step in range(2):
        for i in range(len(SHAPES)):
            np.testing.assert_allclose(scaled[step][0][0][i], want[step][i], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(plain[step][0][0][i], same[step][i], rtol=1e-6, atol=1e-6)
    differs = any(np.abs(scaled[s][0][0][i] - plain[s][0][0][i]).max() > 0.1
                  for s in range(2) for i in range(len(SHAPES)))
    assert differs == average  # f changes the result with op=Average only


def test_outs_receive_the_result_in_place_and_prepare_stops_before_the_last_round():
    comp = build("topk:ratio=0.5")
    engine = Exchange(comp, Loopback())
    x = np.arange(8, dtype=np.float32)
    out = np.full(8, -1.0, np.float32)
    (res,) = engine.run([x], ["w"], new_stats(), outs=[out])
    assert res is out and out[-1] == 7.0
    enc = engine.prepare(np.ones((6, 5), np.float32), "m")
    assert enc.round == 0
    psgd = build("powersgd:rank=1")
    enc = Exchange(psgd, Loopback()).prepare(np.ones((6, 5), np.float32), "m")
    assert enc.round == 1  # PowerSGD's first round ran; Horovod's allreduce is the second


@pytest.mark.filterwarnings("ignore:Horovod cannot allreduce bfloat16")
@pytest.mark.parametrize("spec", ["bf16", "randomk:ratio=0.3+bf16"])
def test_bfloat16_payloads_travel_as_float16_where_the_allreduce_cannot_add_them(spec):
    """Horovod cannot add bfloat16: such payloads (bf16, and random-k's kept values as
    bf16) are sent as float16 -- never as their bit patterns summed as integers."""
    runs, comps, table = _run(spec, steps=1, bf16_sum=False)
    assert all(arr.dtype == np.float16 for posted in table.posted.values()
               for arr in posted.values())
    results, _, batches = runs[0]
    for i, name in enumerate(SHAPES):
        encs = [batches[r].encoded[i] for r in range(3)]
        ref = sum(comps[r].decode(encs[r].payload, encs[r].meta, encs[r].ctx)
                  for r in range(3)) / 3
        np.testing.assert_allclose(results[0][i], ref, rtol=2 ** -7, atol=2 ** -7)


def test_variable_sizes_never_block_at_send_when_ranks_send_in_different_orders():
    """Horovod lets ranks submit collectives in different orders.  Rank 0 sends group A
    then B, rank 1 B then A: a send that waited for its own row lengths (once the case)
    would wait for a collective the other rank has not started, which waits likewise."""
    size, timeout = 2, 5.0
    table = Table(size)
    table.timeout = timeout
    groups = {"A": ("thresholdv:tau=0.5", ["a.weight", "a.bias"]),
              "B": ("adaq:ratio=0.3", ["b.weight"])}
    comps = {g: [build(spec, rank=r, world_size=size) for r in range(size)]
             for g, (spec, _) in groups.items()}
    grads = [dict(zip(SHAPES, _grads(r))) for r in range(size)]
    results, batches, stats, errors = {}, {}, [new_stats() for _ in range(size)], []

    def rank(r):
        try:
            order = ["A", "B"] if r == 0 else ["B", "A"]
            engines = {g: Exchange(comps[g][r], table.rank(r)) for g in order}
            for g in order:
                names = groups[g][1]
                batches[g, r] = engines[g].send([grads[r][n] for n in names], names, stats[r])
            for g in order:
                results[g, r] = engines[g].receive(batches[g, r], stats[r])
        except Exception as exc:  # a thread's error fails the test below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for g, (spec, names) in groups.items():
        for i, name in enumerate(names):
            encs = [batches[g, r].encoded[i] for r in range(size)]
            ref = sum(comps[g][r].decode(e.payload, e.meta, e.ctx) for r, e in enumerate(encs)) / size
            for r in range(size):
                np.testing.assert_allclose(results[g, r][i], ref, rtol=1e-6, atol=1e-7)
    # the sizes really differed between ranks, and the account is exact: per group, the
    # payloads, their int64 lengths and the 8-byte row length, in two collectives
    assert batches["A", 0].encoded[0].nbytes != batches["A", 1].encoded[0].nbytes
    for r in range(size):
        sent = sum(e.nbytes + 8 for g in groups for e in batches[g, r].encoded) + 8 * len(groups)
        assert stats[r]["bytes_sent"] == sent
        assert stats[r]["collectives"] == 2 * len(groups)
