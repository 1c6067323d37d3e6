"""What each exchange costs a worker, and the exchange chosen by cost
(hvd_compress.core.exchangecost): byte counts by hand, and choices with injected links."""

import math
import time

import numpy as np
import pytest

from hvd_compress.core import exchangecost as xc
from hvd_compress.core.exchangecost import (
    ALLGATHER,
    ALLREDUCE,
    HIERARCHICAL,
    HIERARCHICAL_TWO_PHASE,
    TWO_PHASE,
    Links,
)


def header(m):
    """A payload of 2 bytes a value under an 8-byte header."""
    return 8 + 2 * m


def test_chunks_are_numpys_array_split():
    for n, p in ((10, 3), (10, 8), (7, 7), (5, 8), (1000, 64)):
        assert xc.chunk_lengths(n, p) == [len(c) for c in np.array_split(np.arange(n), p)]
    assert xc.chunk_lengths(10.0, 4, exact=False) == [2.5] * 4


@pytest.mark.parametrize("p, rank, sent", [
    # chunks of 10 values: [5,5] -> payloads 18,18; [4,3,3] -> 16,14,14; [3,3,2,2] -> 14,14,12,12;
    # [2,2,1,...] -> 12,12,10 x 6.  Out: the other owners' chunks, then p - 1 copies of one's own
    (2, 0, 18 + 18), (3, 0, 28 + 2 * 16), (3, 1, 30 + 2 * 14), (4, 0, 38 + 3 * 14), (4, 3, 40 + 3 * 12),
    (8, 0, 72 + 7 * 12), (8, 7, 74 + 7 * 10)])
def test_two_phase_bytes_by_hand(p, rank, sent):
    t = xc.traffic(TWO_PHASE, 10, p, 1, header, rank=rank)
    assert (t.sent, t.received) == (sent, sent)  # alltoall + allgather: as much in as out
    assert t.steps == 2 * (p - 1) and t.local_bytes == 0 and t.local_steps == 0
    own = xc.chunk_lengths(10, p)[rank]
    assert (t.encoded, t.decoded) == (10 + own, p * own + 10)  # every chunk + the owner's; ~2n


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_allgather_and_allreduce_bytes_by_hand(p):
    t = xc.traffic(ALLGATHER, 10, p, 1, header)
    assert (t.sent, t.received, t.wire) == ((p - 1) * 28,) * 3
    assert (t.steps, t.encoded, t.decoded) == (p - 1, 10, 10 * p)
    r = xc.traffic(ALLREDUCE, 10, p, 1, header)
    assert r.sent == r.received == {2: 28, 3: 37, 4: 42, 8: 49}[p]  # 2(p-1)*28 // p
    assert (r.steps, r.decoded) == (2 * (p - 1), 10)


def test_two_phase_bytes_per_worker_do_not_grow_with_p():
    n = 840840  # divisible by 2, 3, 4, 8: chunks all n / p

    def plain(m):
        return 2 * m  # no header

    C = plain(n)
    for p in (2, 3, 4, 8, 64, 1024):
        t = xc.traffic(TWO_PHASE, n, p, 1, plain)
        assert t.sent <= 2 * C and t.received <= 2 * C
        if n % p == 0:
            assert t.sent == 2 * (p - 1) * C // p
        g = xc.traffic(ALLGATHER, n, p, 1, plain)
        assert g.received == (p - 1) * C
        # with a header per payload: 2(p-1) headers on top
        h = xc.traffic(TWO_PHASE, n, p, 1, header)
        assert h.sent <= 2 * header(n) + 2 * (p - 1) * 8
    # the cost model's fractions: exactly 2(p-1)/p C
    assert xc.traffic(TWO_PHASE, 1.0, 1024, 1, lambda m: 5e6 * m, exact=False).sent == \
        pytest.approx(2 * 1023 / 1024 * 5e6)


def test_what_crosses_a_nodes_link():
    # flat two-phase, 4 workers in nodes of 2: payloads 14,14,12,12 (52 in all); node 0 sends
    # its 2 workers' chunks of ranks 2, 3 (2 x 24) and receives chunks 0, 1 from 2 workers
    # (2 x 28); its ring link carries all the owners' payloads but rank 2's (out) / rank 0's (in)
    t = xc.traffic(TWO_PHASE, 10, 4, 2, header)
    assert t.wire == max(2 * 24 + (52 - 12), 2 * 28 + (52 - 14)) == 94
    # one node: the worker's own bytes
    assert xc.traffic(TWO_PHASE, 10, 4, 4, header).wire == 80
    # at 1,024 workers in nodes of 8, flat: the node's 8 workers' chunks for the other nodes
    # and one ring: about 9 C; by the hierarchy: its 8 cross sets' two-phase, about 2 C
    big = xc.traffic(TWO_PHASE, 1.0, 1024, 8, lambda m: m, exact=False)
    assert big.wire == pytest.approx(8 * 1016 / 1024 + 1023 / 1024)
    hier = xc.traffic(HIERARCHICAL_TWO_PHASE, 1.0, 1024, 8, lambda m: m, exact=False)
    assert hier.wire == pytest.approx(8 * 2 * 127 / 128 / 8)
    assert xc.traffic(ALLGATHER, 1.0, 1024, 8, lambda m: m, exact=False).wire == 1023


def test_hierarchical_bytes_by_hand():
    # 4 workers in 2 nodes of 2, 10 values: shards of 5; the node's reduce-scatter (40 bytes
    # dense, sends 20) and allgather (sends 20); the shard's payload (18) gathered between 2 nodes
    t = xc.traffic(HIERARCHICAL, 10, 4, 2, header)
    assert (t.sent, t.received, t.wire, t.local_bytes) == (18, 18, 2 * 18, 40)
    assert (t.steps, t.local_steps, t.encoded, t.decoded) == (1, 2, 5, 10)
    assert xc.traffic(HIERARCHICAL, 11, 4, 2, header).local_bytes == 48  # shards of 6, padded
    # integer sums: the shard's payload allreduced among the nodes
    s = xc.traffic(HIERARCHICAL, 10, 8, 2, header, summable=True)  # 4 nodes
    assert (s.sent, s.steps, s.decoded) == (2 * 3 * 18 // 4, 6, 5)
    # two-phase among 4 nodes of 2: the shard of 5 in chunks [2,1,1,1] -> payloads 12,10,10,10
    h = xc.traffic(HIERARCHICAL_TWO_PHASE, 10, 8, 2, header)
    assert (h.sent, h.received, h.wire, h.local_bytes) == (30 + 3 * 12, 30 + 3 * 12, 2 * 66, 40)
    assert (h.steps, h.local_steps, h.encoded, h.decoded) == (6, 2, 5 + 2, 4 * 2 + 5)
    h5 = xc.traffic(HIERARCHICAL_TWO_PHASE, 10, 8, 2, header, rank=5)  # node 2: chunk 2
    assert h5.sent == 32 + 3 * 10 and h5.encoded == 6
    for p, L in ((8, 8), (8, 1), (6, 4)):
        with pytest.raises(ValueError, match="two nodes"):
            xc.traffic(HIERARCHICAL, 10, p, L, header)
    assert xc.flat_of(HIERARCHICAL) == ALLGATHER and xc.flat_of(HIERARCHICAL, True) == ALLREDUCE
    assert xc.flat_of(HIERARCHICAL_TWO_PHASE) == TWO_PHASE
    with pytest.raises(ValueError, match="unknown exchange"):
        xc.traffic("ring", 10, 4, 1, header)


def test_cost_is_the_alpha_beta_sum():
    links = Links(alpha_s=1e-4, s_per_byte=1e-9, local_alpha_s=1e-5, local_s_per_byte=1e-11,
                  encode_s=2e-9, decode_s=1e-9)
    t = xc.traffic(HIERARCHICAL_TWO_PHASE, 10, 8, 2, header)
    assert xc.cost_s(HIERARCHICAL_TWO_PHASE, 10, 8, 2, header, links) == pytest.approx(
        6 * 1e-4 + 132 * 1e-9 + 2 * 1e-5 + 40 * 1e-11 + 7 * 2e-9 + 13 * 1e-9)
    # one node: the collectives at the links inside
    assert xc.cost_s(ALLGATHER, 10, 4, 4, header, links) == pytest.approx(
        3 * 1e-5 + 84 * 1e-11 + 10 * 2e-9 + 40 * 1e-9)
    assert t.local_bytes == 40
    with pytest.raises(ValueError, match="inside a node"):
        xc.cost_s(HIERARCHICAL, 10, 4, 2, header, Links(1e-4, 1e-9))


N = 25_000_000  # a large layer


def topk(m):  # 1%: a value and an index each, and a header
    return 8 * math.ceil(0.01 * m) + 16


def onebit(m):
    return math.ceil(m / 8) + 8


GATHERED = (ALLGATHER, TWO_PHASE, HIERARCHICAL, HIERARCHICAL_TWO_PHASE)


def test_each_exchange_is_picked_where_it_is_cheapest():
    codec = dict(encode_s=1e-9, decode_s=1e-9)
    # fast links, few workers, a sparse decode: the allgather (fewer message steps, nothing
    # to re-encode)
    fast = Links(alpha_s=50e-6, s_per_byte=8 / 100e9, encode_s=1e-9, decode_s=1e-11)
    got = xc.choose(GATHERED, N, 4, 1, topk, fast)
    assert got.exchange == ALLGATHER and set(got.costs) == {ALLGATHER, TWO_PHASE}
    assert got.reason.startswith("allgather: ") and " vs two-phase " in got.reason
    assert "not priced (one node)" in got.reason  # no nodes: the hierarchy is not a candidate
    # many workers: the allgather's p - 1 payloads to receive and decode lose to two-phase
    for comp in (topk, onebit):
        many = xc.choose(GATHERED, N, 1024, 1, comp, Links(50e-6, 8 / 10e9, **codec))
        assert many.exchange == TWO_PHASE and many.costs[ALLGATHER] > 10 * many.costs[TWO_PHASE]
    # nodes of 8, slow links between (1 Gbit/s), fast inside (200 Gbit/s): the hierarchy,
    # two-phase among 128 nodes; among 2 nodes the allgather of shards is the cheaper
    nodes = Links(50e-6, 8 / 1e9, local_alpha_s=5e-6, local_s_per_byte=8 / 200e9, **codec)
    assert xc.choose(GATHERED, N, 1024, 8, topk, nodes).exchange == HIERARCHICAL_TWO_PHASE
    assert xc.choose(GATHERED, N, 16, 8, topk, nodes).exchange == HIERARCHICAL
    # summable payloads: one allreduce whatever is allowed; integer sums may take the hierarchy
    none = xc.choose(xc.EXCHANGES, N, 1024, 8, lambda m: 4 * m, nodes, summable=True)
    assert none.exchange == ALLREDUCE and list(none.costs) == [ALLREDUCE]
    assert "the only exchange priced" in none.reason
    ints = xc.choose(xc.EXCHANGES, N, 1024, 8, lambda m: m // 2 + 8, nodes, summable=True,
                     integer_sum=True)
    assert set(ints.costs) == {ALLREDUCE, HIERARCHICAL}
    with pytest.raises(ValueError, match="fits this compressor"):
        xc.choose([TWO_PHASE], N, 8, 1, lambda m: 4 * m, fast, summable=True)


def test_the_hierarchy_is_refused_where_slower():
    codec = dict(encode_s=1e-9, decode_s=1e-9)
    # the dense node traffic as slow as the link between nodes (the CPU machine's loopback)
    slow_inside = Links(50e-6, 8 / 1e9, local_alpha_s=50e-6, local_s_per_byte=8 / 1e9, **codec)
    got = xc.choose(GATHERED, N, 1024, 8, topk, slow_inside)
    assert got.exchange == TWO_PHASE
    assert got.costs[HIERARCHICAL_TWO_PHASE] > got.costs[TWO_PHASE]
    assert got.costs[HIERARCHICAL] > got.costs[TWO_PHASE]
    # the links inside a node not measured: never the hierarchy
    unknown = xc.choose(GATHERED, N, 1024, 8, topk, Links(50e-6, 8 / 1e9, **codec))
    assert set(unknown.costs) == {ALLGATHER, TWO_PHASE}
    assert "hierarchical, hierarchical+two-phase not priced (no link inside a node measured)" \
        in unknown.reason
    # the hierarchy alone asked for where it cannot run: its flat exchange
    assert xc.choose([HIERARCHICAL], N, 8, 8, topk, slow_inside).exchange == ALLGATHER
    # a tie goes to the flat exchange
    free = Links(0.0, 0.0, local_alpha_s=0.0, local_s_per_byte=0.0)
    assert xc.choose([HIERARCHICAL, ALLGATHER], N, 16, 8, topk, free).exchange == ALLGATHER
    # and so does a hierarchy priced less than HIERARCHY_MARGIN under the best flat exchange
    nodes = Links(50e-6, 8 / 1e9, local_alpha_s=5e-6, local_s_per_byte=8 / 200e9, **codec)
    flat_s = xc.cost_s(ALLGATHER, N, 16, 8, topk, nodes)
    hier_s = xc.cost_s(HIERARCHICAL, N, 16, 8, topk, nodes)
    for under, chosen in ((0.95, ALLGATHER), (1 - xc.HIERARCHY_MARGIN + 0.01, ALLGATHER),
                          (1 - xc.HIERARCHY_MARGIN - 0.01, HIERARCHICAL)):
        got = xc.choose([HIERARCHICAL, ALLGATHER], N, 16, 8, topk, nodes,
                        scale={HIERARCHICAL: under * flat_s / hier_s})
        assert got.exchange == chosen, (under, got.reason)
        assert (f"must be {xc.HIERARCHY_MARGIN:.0%} cheaper" in got.reason) == \
            (chosen == ALLGATHER), got.reason


def test_link_from_timings():
    alpha, beta = 30e-6, 2e-10
    timings = [(s, b, s * alpha + b * beta) for s, b in ((1, 1e3), (7, 1e6), (14, 8e7), (3, 5e5))]
    got = xc.link_from_timings(timings)
    assert got == pytest.approx((alpha, beta), rel=1e-6)
    # one kind of collective (steps proportional to nothing): the bytes alone
    assert xc.link_from_timings([(0, 1e6, 1e-3), (0, 2e6, 2e-3)]) == pytest.approx((0.0, 1e-9))
    with pytest.raises(ValueError):
        xc.link_from_timings([])


def test_link_fit_keeps_the_message_step_under_noise_that_grows_with_the_time():
    """auto's probes (1 KiB, 256 KiB, 4 MiB; an allreduce and an allgather each, 2 ranks a
    cross set) at 200 Mbit/s with 0.2 ms a message step, each time off by up to 10% either
    way: fitted on relative errors, the message step comes out within a factor 1.5 and
    every probe's time within 15%, in 200 draws.  (Fitted on the seconds themselves, a
    few ms of noise on the 4 MiB probes decided the 0.2 ms: 0 s in 78 draws of the 200,
    within the factor 1.5 in 14.)"""
    alpha, beta, p = 2e-4, 4e-8, 2
    rows = []
    for nbytes in (1 << 10, 1 << 18, 1 << 22):
        rows += [(2 * (p - 1), 2 * (p - 1) * nbytes // p), (p - 1, (p - 1) * nbytes)]
    rng = np.random.default_rng(38)
    for _ in range(200):
        timed = [(a, b, (a * alpha + b * beta) * rng.uniform(0.9, 1.1)) for a, b in rows]
        got_a, got_b = xc.link_from_timings(timed)
        assert alpha / 1.5 <= got_a <= alpha * 1.5, (got_a, timed)
        assert got_b == pytest.approx(beta, rel=0.15)
        for a, b, t in timed:
            assert a * got_a + b * got_b == pytest.approx(t, rel=0.15)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "onebit", "signsgd", "terngrad", "qsgd:levels=4"])
def test_the_two_phase_engines_account_is_the_formula(spec):
    """The two-phase engine (hvd_compress.core.twophase) on simulated ranks: every rank's
    account (``wire_out`` / ``wire_in``) is :func:`traffic`'s sent and received, exactly,
    with the worker's and the owner's payload sizes for a chunk."""
    import threading

    from hvd_compress.core import build, new_stats
    from hvd_compress.core.twophase import TwoPhase, chunk_name, owner_of
    from tests.test_exchange_engine import Table

    shape, n = (240, 100), 24000
    for p in (2, 3, 4, 8):
        table = Table(p)
        comps = [build(spec, rank=r, world_size=p) for r in range(p)]
        engines = [TwoPhase(c, table.rank(r)) for r, c in enumerate(comps)]
        stats = [new_stats() for _ in range(p)]
        grads = [np.random.default_rng([r, 7]).standard_normal(shape).astype(np.float32) for r in range(p)]
        threads = [threading.Thread(target=engines[r].run, args=([grads[r]], ["w"], stats[r]))
                   for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        comp = comps[0]

        def size(c):
            return lambda m: c.payload_nbytes(c.meta_for(np.zeros((m, 1), np.float32), chunk_name("w", 0, p)))

        for r in range(p):
            want = xc.traffic(TWO_PHASE, n, p, 1, size(comp), rank=r, owner_bytes=size(owner_of(comp)))
            assert (stats[r].wire_out, stats[r].wire_in) == (want.sent, want.received), (spec, p, r)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "onebit", "qsgd:levels=4"])
def test_the_hierarchical_engines_account_is_the_formula(spec):
    """The hierarchical engine (hvd_compress.core.hierarchy) on simulated nodes: every rank's
    bytes between nodes (``wire_out`` / ``wire_in``, over its cross set) and its dense bytes
    inside the node (``local_bytes``) are :func:`traffic`'s, exactly."""
    import threading

    from hvd_compress.core import build, new_stats
    from hvd_compress.core.hierarchy import shard_name
    from tests.test_hierarchy import Cluster

    shape, n = (240, 100), 24000
    for nodes, per in ((2, 2), (3, 2), (2, 3), (4, 2)):
        cl, p = Cluster(nodes, per), nodes * per
        comps = [build(spec, rank=r, world_size=p) for r in range(p)]
        engines = [cl.engine(comps[r], r) for r in range(p)]
        stats = [new_stats() for _ in range(p)]
        grads = [np.random.default_rng([r, 5]).standard_normal(shape).astype(np.float32) for r in range(p)]
        threads = [threading.Thread(target=engines[r].run, args=([grads[r]], ["w"], stats[r]))
                   for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        comp = comps[0]

        def size(m):
            return comp.payload_nbytes(comp.meta_for(np.zeros((m, 1), np.float32), shard_name("w", 0, per)))

        for r in range(p):
            want = xc.traffic(HIERARCHICAL, n, p, per, size, rank=r)
            got = (stats[r].wire_out, stats[r].wire_in, stats[r].local_bytes)
            assert got == (want.sent, want.received, want.local_bytes), (spec, nodes, per, r)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_codec_calls_per_exchange(p):
    """The allgather encodes once and decodes p payloads; two-phase encodes p chunks and
    the owner's sum, decodes p contributions and p owners' chunks; the hierarchy's calls
    are its exchange among the N nodes'."""
    calls = {e: (t.encode_calls, t.decode_calls) for e in xc.EXCHANGES[:3]
             for t in [xc.traffic(e, 1000, p, 1, header)]}
    assert calls == {ALLREDUCE: (1, 1), ALLGATHER: (1, p), TWO_PHASE: (p + 1, 2 * p)}
    h = xc.traffic(HIERARCHICAL, 1000, 4 * p, 4, header)
    h2 = xc.traffic(HIERARCHICAL_TWO_PHASE, 1000, 4 * p, 4, header)
    assert (h.encode_calls, h.decode_calls) == (1, p)
    assert (h2.encode_calls, h2.decode_calls) == (p + 1, 2 * p)


def test_a_codec_calls_fixed_cost_is_priced():
    """Each codec call's fixed cost counts once a call: with a call as dear as 10 ms,
    two-phase's 2p + 1 calls at p = 8 cost 170 ms more than nothing; where per-value rates
    alone would pick two-phase for a middling tensor, the calls' cost turns it to the
    allgather (p + 1 calls)."""
    base = dict(alpha_s=50e-6, s_per_byte=8 / 1e9, encode_s=1e-9, decode_s=1e-9)
    per_value = Links(**base)
    called = Links(**base, encode_call_s=10e-3, decode_call_s=10e-3)
    n, p = 400_000, 8
    assert xc.cost_s(TWO_PHASE, n, p, 1, onebit, called) == pytest.approx(
        xc.cost_s(TWO_PHASE, n, p, 1, onebit, per_value) + (p + 1 + 2 * p) * 10e-3)
    assert xc.choose(GATHERED, n, p, 1, onebit, per_value).exchange == TWO_PHASE
    assert xc.choose(GATHERED, n, p, 1, onebit, called).exchange == ALLGATHER


class _SleepyCodec:
    """A compressor whose encode and decode take ``fixed + per * values`` seconds."""

    def __init__(self, fixed, per):
        self.fixed, self.per = fixed, per

    def _wait(self, m):
        import time
        time.sleep(self.fixed + self.per * m)

    def chunked(self, shape):
        return True

    def encode(self, x, name):
        from types import SimpleNamespace
        self._wait(x.size)
        return SimpleNamespace(payload=x, meta=x.size, ctx=None)

    def decode(self, payload, meta, ctx):
        self._wait(meta)
        return payload

    def aggregate(self, received, enc):
        for payload in received:
            self.decode(payload, enc.meta, enc.ctx)
        self.summed = len(received)
        return enc.payload


def test_codec_timing_tells_a_calls_fixed_cost_from_its_rate():
    """The probe times the codecs at two sizes: the line through them gives the fixed
    cost a call and the cost per value (one size alone took 5 ms a call for a rate)."""
    from hvd_compress.core.autoexchange import codec_seconds
    from hvd_compress.core.backend import NUMPY
    fixed, per = 20e-3, 5e-8  # (sleeps overshoot by a ms or two on a busy machine)
    codec = _SleepyCodec(fixed, per)
    ev, dv, ec, dc = codec_seconds(codec, NUMPY, None, largest=1 << 20, p=8)
    for rate, call in ((ev, ec), (dv, dc)):
        assert rate == pytest.approx(per, rel=0.35) and call == pytest.approx(fixed, rel=0.35)
    # the decode was timed as the allgather runs it: a sum of payloads (at most 4 of them),
    # its figures one payload's share
    assert codec.summed == 4
    _, dv, _, dc = codec_seconds(codec, NUMPY, None, largest=1 << 20, p=1)
    assert codec.summed == 2
    assert dv == pytest.approx(per, rel=0.35) and dc == pytest.approx(fixed, rel=0.35)
    # a small model: the large probe is the largest tensor, at least 16K values
    ev, _, ec, _ = codec_seconds(_SleepyCodec(fixed, 1e-6), NUMPY, None,
                                 largest=100)
    assert ev == pytest.approx(1e-6, rel=0.35) and ec == pytest.approx(fixed, rel=0.35)



class _TimedLink:
    """One rank of a ``size``-rank set whose collectives take ``alpha`` a message step plus
    ``beta`` a byte on the wire (by :func:`~.exchangecost.traffic`'s counting), by sleeping;
    it keeps what it ran (the other ranks are imagined: a MAX returns this rank's figure)."""

    def __init__(self, size, alpha, beta):
        self.size, self.alpha, self.beta, self.ran = size, alpha, beta, []

    def allreduce(self, x, name, op=None):
        self.ran.append((name, np.asarray(x).nbytes))
        return ("allreduce", np.asarray(x), op)

    def allgather(self, x, name):
        self.ran.append((name, np.asarray(x).nbytes))
        return ("allgather", np.asarray(x), None)

    def wait(self, handle):
        kind, x, op = handle
        if op is None:
            p, n = self.size, x.nbytes
            steps, wire = ((2 * (p - 1), 2 * (p - 1) * n // p) if kind == "allreduce"
                           else (p - 1, (p - 1) * n))
            time.sleep(self.alpha * steps + self.beta * wire)
        return x


def test_the_link_probe_sees_a_per_byte_cost_that_latency_hides():
    """At 1 Gbit/s behind 6 ms a message step, 256 KiB move in 2 ms: the 4 MiB probes make
    the cost per byte show (the fit prices bytes at about 8 ns, not 0); where the 256 KiB
    probes already take over 50 ms (a slow link), the 4 MiB ones are not run, and their
    rows are left out of the fit.  Which runs is agreed over the set (one MAX allreduce)."""
    from hvd_compress.core import autoexchange as ax
    from hvd_compress.core.backend import NUMPY
    fast = _TimedLink(2, 6e-3, 8e-9)
    rows = ax.probe_timings(fast, NUMPY, None, "t")
    assert [b for _, b, _ in rows] == [1024, 1024, 1 << 18, 1 << 18, 1 << 22, 1 << 22]
    assert all(t > 0 for _, _, t in rows)
    assert sum(name == "hvd_compress.probe.t.large" for name, _ in fast.ran) == 1
    alpha, beta = ax.AutoChoice._fit([t for _, _, t in rows], 2)
    assert beta == pytest.approx(8e-9, rel=0.3) and alpha == pytest.approx(6e-3, rel=0.3)
    slow = _TimedLink(2, 1e-3, 8e-7)  # 10 Mbit/s: 256 KiB take 0.2 s
    rows = ax.probe_timings(slow, NUMPY, None, "t")
    assert [t for _, _, t in rows[4:]] == [ax.SKIPPED, ax.SKIPPED]
    assert max(nbytes for _, nbytes in slow.ran) < 1 << 22  # nothing of 4 MiB was sent
    alpha, beta = ax.AutoChoice._fit([t for _, _, t in rows], 2)
    assert beta == pytest.approx(8e-7, rel=0.3)
