"""The plan agreement check's logic without processes: fingerprints, the differences it
names, the two-phase gather (threads stand in for ranks), and the engine's once-per-plan."""

import threading

import numpy as np
import pytest

from hvd_compress import PlanMismatchError
from hvd_compress.core import NUMPY, Collectives, Exchange, agreement, build
from hvd_compress.spec import parse

TENSORS = [("fc.weight", (4, 3), "float32"), ("fc.bias", (4,), "float32")]


def _plan(spec="topk:ratio=0.01", op="Average", tensors=TENSORS, **more):
    return agreement.plan("torch.DistributedOptimizer", parse(spec), op, 1.0, 1, tensors, **more)


def _run_ranks(plans):
    """``agreement.check`` on one thread per rank over a shared in-memory allgather;
    returns each rank's exception (None where it passed) and how many gathers ran."""
    n = len(plans)
    barrier = threading.Barrier(n)
    slots, calls, errors = [None] * n, [0] * n, [None] * n

    def rank(r):
        def gather(data, lengths):
            calls[r] += 1
            slots[r] = data
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        try:
            agreement.check(plans[r], gather)
        except PlanMismatchError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors, calls


def test_fingerprint_is_stable_and_sees_every_field():
    base = _plan()
    assert agreement.fingerprint(base) == agreement.fingerprint(_plan())
    assert len(agreement.fingerprint(base)) == 32
    for other in (_plan("topk:ratio=0.1"), _plan(op="Sum"), _plan(tensors=TENSORS[::-1]),
                  _plan(delay=1), _plan(tensors=[("fc.weight", (3, 4), "float32")] + TENSORS[1:])):
        assert agreement.fingerprint(other) != agreement.fingerprint(base)


def test_the_plan_holds_every_resolved_parameter():
    p = _plan("topk:ratio=0.01")
    assert p["compression"] == str(parse("topk:ratio=0.01"))
    assert "ratio=0.01" in p["compression"] and "ef=" in p["compression"]
    assert p["tensors"] == [["fc.weight", [4, 3], "float32"], ["fc.bias", [4], "float32"]]


def test_differences_name_the_fields():
    assert agreement.differences(_plan(), _plan()) == []
    assert agreement.differences(_plan(), _plan("qsgd", op="Sum")) == ["compression", "op"]
    assert agreement.differences(_plan(), _plan(delay=2)) == ["delay"]


def test_message_names_both_sides():
    msg, fields = agreement.mismatch_message([_plan("topk:ratio=0.01"), _plan("topk:ratio=0.1")])
    assert fields == ["compression"]
    assert "rank 0 uses compression='topk:ratio=0.01" in msg
    assert "rank 1 uses compression='topk:ratio=0.1" in msg
    msg, fields = agreement.mismatch_message([_plan(), _plan(), _plan(op="Sum"), _plan()])
    assert "ranks 0, 1, 3 use op='Average'" in msg and "rank 2 uses op='Sum'" in msg


def test_message_says_how_the_tensors_differ():
    extra = TENSORS + [("extra.weight", (2,), "float32")]
    msg, fields = agreement.mismatch_message([_plan(), _plan(tensors=extra)])
    assert fields == ["tensors"]
    assert "rank 0 exchanges 2 tensors, rank 1 3" in msg
    assert "only rank 1 has 'extra.weight' (2,) float32" in msg
    reshaped = [("fc.weight", (3, 4), "float32"), TENSORS[1]]
    msg, _ = agreement.mismatch_message([_plan(), _plan(tensors=reshaped)])
    assert "'fc.weight' (4, 3) float32 vs (3, 4) float32" in msg
    msg, _ = agreement.mismatch_message([_plan(), _plan(tensors=TENSORS[::-1])])
    assert "in another order" in msg
    many = [(f"t{i}", (1,), "float32") for i in range(10)]
    msg, _ = agreement.mismatch_message([_plan(tensors=[]), _plan(tensors=many)])
    assert "'t0' (1,) float32, 't1' (1,) float32, 't2' (1,) float32 and 7 more" in msg


def test_agreeing_ranks_pass_with_one_gather():
    errors, calls = _run_ranks([_plan(), _plan(), _plan()])
    assert errors == [None] * 3 and calls == [1] * 3


def test_every_rank_raises_the_same_error_naming_both_sides():
    errors, calls = _run_ranks([_plan("topk:ratio=0.01"), _plan("topk:ratio=0.1", op="Sum")])
    assert calls == [2, 2]
    assert all(isinstance(e, PlanMismatchError) and isinstance(e, ValueError) for e in errors)
    assert str(errors[0]) == str(errors[1])
    assert errors[0].fields == ("compression", "op")
    assert errors[0].plans[1]["op"] == "Sum"


class _Rows(Collectives):
    """An allgather whose other ranks sent ``rows`` (flat concatenation, as Horovod's)."""

    def __init__(self, others, rank=0, split=False):
        self.others, self.rank, self.split, self.names = others, rank, split, []

    @property
    def size(self):
        return len(self.others) + 1

    def allgather(self, flat, name):
        self.names.append(name)
        rows = list(self.others)
        rows.insert(self.rank, flat)
        return rows if self.split else np.concatenate(rows)


@pytest.mark.parametrize("split", [False, True])
def test_gather_bytes_splits_the_ranks_rows(split):
    row = np.frombuffer(b"rank-one-plan", dtype=np.uint8)
    coll = _Rows([row], split=split)
    got = agreement.gather_bytes(coll, NUMPY, b"zero", [4, len(row)])
    assert got == [b"zero", b"rank-one-plan"] and coll.names == ["hvd_compress.plan.full"]
    coll = _Rows([np.arange(40, dtype=np.uint8)], split=split)
    got = agreement.gather_bytes(coll, NUMPY, bytes(40), None)
    assert got == [bytes(40), bytes(range(40))] and coll.names == ["hvd_compress.plan"]


def test_the_engine_checks_once_per_plan():
    p = _plan()
    header = agreement.fingerprint(p) + len(agreement._encode(p)).to_bytes(8, "little")
    coll = _Rows([np.frombuffer(header, dtype=np.uint8)])
    engine = Exchange(build("topk:ratio=0.5"), coll)
    for _ in range(3):
        engine.agree(lambda: p)
        engine.agree(p, key="fixed")
    assert coll.names == ["hvd_compress.plan"] * 2  # once for the fingerprint, once for "fixed"
    other = _plan(tensors=TENSORS[:1])
    with pytest.raises(PlanMismatchError, match="only rank 1 has 'fc.bias'"):
        coll.others = [np.frombuffer(header, dtype=np.uint8)]
        coll.allgather = _answer(coll, agreement._encode(p))
        engine.agree(other)  # a new tensor set: checked again, and rank 1 still has both


def _answer(coll, full):
    """Rank 1's header, then its whole plan, as the second gather wants it."""
    original = coll.allgather

    def allgather(flat, name):
        if name.endswith(".full"):
            coll.others = [np.frombuffer(full, dtype=np.uint8)]
        return original(flat, name)
    return allgather


def test_one_rank_needs_no_collective():
    class Never(Collectives):
        def allgather(self, flat, name):
            raise AssertionError("no collective on one rank")
    Exchange(build("none"), Never()).agree(_plan())
