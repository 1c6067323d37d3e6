"""The cost model knows the two-phase exchange (hvd_compress.tools.costmodel over
hvd_compress.core.exchangecost): its bytes, message steps and decodes, flat and among nodes,
and fits its runs with the others."""

import dataclasses
import math

import pytest

from hvd_compress.tools import costmodel
from hvd_compress.tools.costmodel import ALLGATHER, ALLREDUCE, TWO_PHASE, Link, Profile, Sample


def test_two_phase_wire_bytes_and_hops():
    S = 1000.0
    for p in (2, 8, 64, 1024):
        assert costmodel.wire_bytes(TWO_PHASE, p, S) == pytest.approx(2 * (p - 1) / p * S)  # < 2 S
        assert costmodel.wire_bytes(ALLGATHER, p, S) == (p - 1) * S
        assert costmodel.hops(TWO_PHASE, p) == 2 * (p - 1)  # alltoall + allgather
    # flat in nodes of 8: the node's link carries its 8 workers' chunks for the other nodes
    assert costmodel.wire_bytes(TWO_PHASE, 1024, S, 8) == pytest.approx((8 * 1016 + 1023) / 1024 * S)
    # hierarchical: each of the node's 8 cross sets, two-phase among 128 nodes, of a shard's payload
    assert costmodel.wire_bytes(TWO_PHASE, 1024, S, 8, True) == pytest.approx(8 * 2 * 127 / 128 * S)
    assert costmodel.hops(TWO_PHASE, 1024, 8, True) == 254
    assert costmodel.exchange_of(TWO_PHASE, True) == "hierarchical+two-phase"
    assert costmodel.exchange_of(ALLREDUCE, True) == "hierarchical"
    with pytest.raises(ValueError, match="unknown collective"):
        costmodel.wire_bytes("ring", 4, S)


def test_two_phase_profile_scaling():
    """Decoding stays at about two tensors whatever p; encoding is a tensor and the owner's
    chunk; payload bytes do not change."""
    f = Profile("c", TWO_PHASE, compute_ms=50, encode_ms=10, decode_ms=8, nbytes=1000, measured_p=4)
    assert f.decode_at(1024) == pytest.approx(8) and f.decode_at(2) == pytest.approx(8)
    assert f.encode_at(1024) == pytest.approx(10 * (1 + 1 / 1024) / (1 + 1 / 4))
    assert f.nbytes_at(1024) == 1000
    t = f.traffic_at(1024)
    assert t.sent == t.received == pytest.approx(2 * 1023 / 1024 * 1000)
    # hierarchical, measured flat (one node of 4): a shard of 1/8 at 1024 in nodes of 8
    h = dataclasses.replace(f, hierarchical=True, per_node=4, dense_bytes=4e6)
    assert not h.active(4, 4) and h.active(1024, 8)
    assert h.encode_at(1024, 8) == pytest.approx(10 * (1 / 8 + 1 / 1024) / (1 + 1 / 4))
    assert h.decode_at(1024, 8) == pytest.approx(8 * (2 / 8) / 2)
    assert h.nbytes_at(1024, 8) == pytest.approx(125)
    assert h.local_bytes_at(1024, 8) == pytest.approx(2 * 7 / 8 * 4e6)
    th = h.traffic_at(1024, 8)
    assert th.sent == pytest.approx(2 * 127 / 128 * 125) and th.wire == pytest.approx(8 * th.sent)
    assert th.local_bytes == pytest.approx(7e6)


def test_the_chunks_codec_work_grows_with_the_workers():
    """What the two-phase exchange's codec work costs per tensor and chunk (``chunk_ms``)
    is added for every chunk more than measured: p two-phase, the nodes hierarchical+two-
    phase; nothing where the tensors were not counted or the exchange cuts no chunks."""
    f = Profile("c", TWO_PHASE, compute_ms=50, encode_ms=10, decode_ms=8, nbytes=1000,
                measured_p=4, tensors=3, chunk_ms=0.01)
    assert f.chunks_at(4) == 4 and f.chunks_at(1024) == 1024 and f.chunks_at(1) == 0
    assert f.encode_at(4) == pytest.approx(10) and f.decode_at(1024) == pytest.approx(8)
    assert f.encode_at(1024) == pytest.approx(10 * (1 + 1 / 1024) / 1.25 + 3 * 0.01 * 1020)
    assert dataclasses.replace(f, tensors=0).encode_at(1024) == pytest.approx(10 * (1 + 1 / 1024) / 1.25)
    h = dataclasses.replace(f, hierarchical=True, per_node=4, dense_bytes=4e6)
    assert h.chunks_at(1024, 8) == 128  # two-phase among the 128 nodes
    # the allgather cuts no chunks; counted as two-phase, its chunks' work at the measured p
    g = Profile("c", ALLGATHER, 50, 10, 8, nbytes=1000, measured_p=2, tensors=3, chunk_ms=0.5)
    assert g.chunks_at(1024) == 0 and g.encode_at(1024) == pytest.approx(10)
    t = g.as_exchange(TWO_PHASE)
    assert t.encode_ms == pytest.approx(10 * 1.5 + 3 * 0.5 * 2) and t.tensors == 3
    # (what was measured scales with the values, the chunks' work with the chunks added)
    assert t.encode_at(1024) == pytest.approx(18 * (1 + 1 / 1024) / 1.5 + 3 * 0.5 * 1022)


def test_an_allgather_profile_counted_for_two_phase():
    g = Profile("c", ALLGATHER, compute_ms=50, encode_ms=10, decode_ms=8, nbytes=1000, measured_p=2)
    t = g.as_exchange(TWO_PHASE)
    # at 2 workers: a tensor and the owner's half encoded (1.5), two tensors decoded either way
    assert (t.collective, t.encode_ms, t.decode_ms, t.nbytes) == (TWO_PHASE, 15, 8, 1000)
    # the same compressor's payloads at 1024 workers: the allgather decodes 1024 of them
    assert g.decode_at(1024) == pytest.approx(8 * 512) and t.decode_at(1024) == pytest.approx(8)
    h = dataclasses.replace(g, dense_bytes=4e6).as_exchange(TWO_PHASE, True)
    assert h.hierarchical and h.nbytes == 1000 and h.encode_at(1024, 8) == pytest.approx(
        10 * (1 / 8 + 1 / 1024))
    # from a hierarchical run (2 nodes of 2): the shard's payload back to the tensor's
    hg = Profile("c", ALLGATHER, 50, 5, 4, nbytes=500, measured_p=4, per_node=2, hierarchical=True,
                 local_bytes=4e6, dense_bytes=4e6)
    ht = hg.as_exchange(TWO_PHASE)
    assert ht.nbytes == pytest.approx(1000) and ht.encode_ms == pytest.approx(5 / 0.5 * 1.25)
    assert ht.local_bytes == 0


def test_step_of_the_two_phase_exchange():
    link = Link(alpha_s=1e-4, efficiency=0.5, local_s_per_bit=1e-9)
    f = Profile("c", TWO_PHASE, compute_ms=50, encode_ms=10, decode_ms=8, nbytes=1000, measured_p=4)
    model = costmodel.StepModel({ALLREDUCE: link, ALLGATHER: link}, {"c": f})  # two-phase: allgather's
    comm = 2046 * 1e-4 + 8 * 2 * 1023 / 1024 * 1000 / (0.5 * 1e10)
    assert model.step_ms("c", 1024, 1e10) == pytest.approx(50 + f.encode_at(1024) + 8 + 1e3 * comm)
    h = dataclasses.replace(f, hierarchical=True, dense_bytes=4e6)
    model.profiles["h"] = h
    cross = 254 * 1e-4 + 8 * 8 * 2 * 127 / 128 * 125 / (0.5 * 1e10)
    local = 8 * 7e6 / (0.5 * 2e11)
    assert model.step_ms("h", 1024, 1e10, 8, 2e11) == pytest.approx(
        50 + h.encode_at(1024, 8) + 1 + 1e3 * (cross + local))


def test_fit_model_fits_two_phase_samples_with_the_allgathers():
    """Two-phase samples share the allgather's link (groups of their own): the fit recovers
    the link and every offset; a group in both links' samples is refused."""
    truth = Link(alpha_s=50e-6, efficiency=0.7, local_s_per_bit=2e-10)
    samples = []
    cases = [(ALLGATHER, "a", 0.03, 2e6, False), (ALLGATHER, "b", 0.01, 5e5, False),
             (TWO_PHASE, "a (two-phase)", 0.05, 2e6, False), (TWO_PHASE, "a (two-phase)", 0.05, 1e6, True),
             (ALLREDUCE, "none", 0.1, 8e7, False)]
    for coll, group, offset, nbytes, hier in cases:
        for p in (4, 8):
            for bw in (2e8, 1e9, math.inf):
                local = 2 * 1 / 2 * 8e7 if hier else 0.0
                t = max(0.0, offset + truth.comm_s(coll, p, nbytes, bw, 1.0, 2, hier, local))
                samples.append(Sample(coll, p, nbytes, bw, 1.0, t, group, 1.0 + t, 2, hier, local))
    links, offsets = costmodel.fit_model(samples)
    assert links[TWO_PHASE] is links[ALLGATHER]
    assert links[ALLGATHER].efficiency == pytest.approx(0.7, rel=1e-3)
    assert links[ALLGATHER].alpha_s == pytest.approx(50e-6, rel=1e-2)
    assert links[ALLGATHER].local_s_per_bit == pytest.approx(2e-10, rel=1e-2)
    assert offsets == pytest.approx({"a": 0.03, "b": 0.01, "a (two-phase)": 0.05, "none": 0.1}, abs=1e-4)
    clash = [dataclasses.replace(s, group="a") for s in samples if s.collective == ALLREDUCE]
    with pytest.raises(ValueError, match="both links"):
        costmodel.fit_model(samples + clash)
