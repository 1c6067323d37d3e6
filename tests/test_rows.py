"""Typed rows that read like the dicts they replaced (issue 37, part 3): a wrapper's plan
rows (:class:`hvd_compress.core.planrow.PlanRow`) and compare's run rows
(:class:`hvd_compress.tools.runrow.RunRow`)."""

from __future__ import annotations

import pytest

from hvd_compress.core.planrow import PlanRow
from hvd_compress.pertensor import format_plan

ROW = {"name": "fc1.weight", "shape": (64, 2048), "dtype": "float32",
       "compression": "topk:ratio=0.01,ef=true", "compressed": True, "bytes": 10488}


def test_a_plan_row_reads_like_the_dict_it_replaced():
    row = PlanRow(**ROW)
    assert (row.name, row.shape, row.compression, row.compressed, row.bytes) == (
        "fc1.weight", (64, 2048), "topk:ratio=0.01,ef=true", True, 10488)
    assert row["bytes"] == 10488 and row.get("dtype") == "float32" and row.get("nosuch") is None
    assert list(row) == list(row.keys()) == list(ROW)
    assert list(row.items()) == list(ROW.items()) and list(row.values()) == list(ROW.values())
    assert dict(row) == ROW and row == ROW and ROW == row and len(row) == 6
    assert "bytes" in row and "nosuch" not in row
    with pytest.raises(KeyError):
        row["nosuch"]
    assert row != dict(ROW, bytes=1) and row != PlanRow(**dict(ROW, compressed=False))
    copy = row.copy()
    copy["bytes"] = 7
    assert (copy.bytes, row.bytes) == (7, 10488)
    with pytest.raises(KeyError):
        copy["nosuch"] = 1
    # a dict of the fields (a user's own rows) becomes a row; other keys are ignored
    assert PlanRow.of(dict(ROW, extra=1)) == row and PlanRow.of(row) is row


ENTRIES = [("fc1.weight", (64, 2048), "float32"), ("fc1.bias", (64,), "float32"),
           ("emb.weight", (100, 40), "float32"), ("conv.weight", (16, 1, 3, 3), "float32"),
           ("scale", (), "float32"), ("out.weight", (4, 64), "float16")]
# what format_plan printed for these plans before the rows were typed (0.2.8's code)
MIXED = """\
tensor       shape             bytes/step  compression
fc1.weight   64x2048               10,488  topk:ratio=0.01,ef=true
fc1.bias     64                       256  none
emb.weight   100x40                 2,032  qsgd:levels=4,bucket=512,ef=false,seed=0,sum=gather
conv.weight  16x1x3x3                 576  none
scale        scalar                     4  none
out.weight   4x64                     512  none
6 tensors, 2 compressed, 13,868 bytes/step; uncompressed for the first 5 steps"""
DGC_LINES = ["fc1.bias     64                       256  none (with DGC's momentum)",
             "6 tensors, 2 compressed, 432,052 bytes/step"]
SINGLE = """\
tensor       shape             bytes/step  compression
fc1.weight   64x2048              104,864  topk:ratio=0.1,ef=true
fc1.bias     64                        56  topk:ratio=0.1,ef=true
emb.weight   100x40                 3,200  topk:ratio=0.1,ef=true
conv.weight  16x1x3x3                 120  topk:ratio=0.1,ef=true
scale        scalar                     8  topk:ratio=0.1,ef=true
out.weight   4x64                     208  topk:ratio=0.1,ef=true
6 tensors, 6 compressed, 108,456 bytes/step"""


def test_plans_are_typed_rows_and_print_as_before():
    """A per-tensor policy's plan and a single compressor's (the wrappers' ``plan()``):
    PlanRow objects equal to the dicts they were, printed as before (from the rows or
    from their dicts)."""
    tc = pytest.importorskip("hvd_compress.torch.compressors")
    from hvd_compress.core import policy as pm
    mixed = tc.TorchPolicy(pm.Policy("*fc*=topk:ratio=0.01;*emb*=qsgd:levels=4;*=onebit",
                                     min_numel=1024, start_step=5)).plan(ENTRIES)
    dgc = tc.TorchPolicy(pm.Policy("dgc:ratio=0.01", min_numel=1024)).plan(ENTRIES)
    single = tc.compressor("topk:ratio=0.1").plan(ENTRIES)
    for rows in (mixed, dgc, single):
        assert all(type(r) is PlanRow for r in rows)
        assert [(r.name, r.shape, r.dtype) for r in rows] == ENTRIES
    assert mixed[0] == ROW and dict(mixed[1]) == {
        "name": "fc1.bias", "shape": (64,), "dtype": "float32", "compression": "none",
        "compressed": False, "bytes": 256}
    assert format_plan(mixed, 5) == format_plan([dict(r) for r in mixed], 5) == MIXED
    lines = format_plan(dgc).splitlines()
    assert lines[2] == DGC_LINES[0] and lines[-1] == DGC_LINES[1]
    assert [r.compressed for r in dgc] == [True, False, True, False, False, False]
    assert format_plan(single) == SINGLE
