"""Typed rows that read like the dicts they replaced (issue 37, part 3): a wrapper's plan
rows (:class:`hvd_compress.core.planrow.PlanRow`) and compare's run rows
(:class:`hvd_compress.tools.runrow.RunRow`)."""

from __future__ import annotations

import pytest

from hvd_compress.core.planrow import PlanRow
from hvd_compress.pertensor import format_plan
from hvd_compress.tools.runtools import SUMMARY_KEYS

ROW = {"name": "fc1.weight", "shape": (64, 2048), "dtype": "float32",
       "compression": "topk:ratio=0.01,ef=true", "compressed": True, "bytes": 10488,
       "exchange": "two-phase", "why": "two-phase: 1.2 ms vs allgather 3.4 ms"}


def test_a_plan_row_reads_like_the_dict_it_replaced():
    row = PlanRow(**ROW)
    assert (row.name, row.shape, row.compression, row.compressed, row.bytes) == (
        "fc1.weight", (64, 2048), "topk:ratio=0.01,ef=true", True, 10488)
    assert row["bytes"] == 10488 and row.get("dtype") == "float32" and row.get("nosuch") is None
    assert list(row) == list(row.keys()) == list(ROW)
    assert list(row.items()) == list(ROW.items()) and list(row.values()) == list(ROW.values())
    assert dict(row) == ROW and row == ROW and ROW == row and len(row) == 8
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
    # (a compressor's plan does not know the exchange: the wrappers' fill it in)
    assert mixed[0] == dict(ROW, exchange="", why="") and dict(mixed[1]) == {
        "name": "fc1.bias", "shape": (64,), "dtype": "float32", "compression": "none",
        "compressed": False, "bytes": 256, "exchange": "", "why": ""}
    assert format_plan(mixed, 5) == format_plan([dict(r) for r in mixed], 5) == MIXED
    lines = format_plan(dgc).splitlines()
    assert lines[2] == DGC_LINES[0] and lines[-1] == DGC_LINES[1]
    assert [r.compressed for r in dgc] == [True, False, True, False, False, False]
    assert format_plan(single) == SINGLE


# -- compare's rows -----------------------------------------------------------------------------
# results.csv's columns before the rows were typed (0.2.8's plan.COLUMNS after the summary keys)
ADDED_COLUMNS = ["bandwidth", "latency", "status", "step_ms", "collectives_per_step", "parameters",
                 "log", "mode", "target_accuracy", "time_to_target_s", "epochs_to_target",
                 "best_accuracy", "curve", "nodes", "local_bytes_per_step", "hierarchical"]
# appended since (issue 38: compare --hosts; issue 39: --device; issue 40: the language model;
# issue 38 again: the account's codec calls), after the older ones, which keep their places
LATER_COLUMNS = ["hosts", "link_bandwidth", "exchange", "wire_in_per_step", "wire_out_per_step",
                 "device", "optimizer", "tokens_per_sec", "val_loss", "best_loss", "target_loss",
                 "steps_to_target", "encode_calls_per_step", "decode_calls_per_step",
                 "tensors_per_step", "repeat"]
PLANNED = {"framework": "torch", "example": "digits", "compression": "topk:ratio=0.01", "np": 2,
           "bandwidth": "1gbit", "latency": "", "mode": "sync", "nodes": 1}


def test_a_run_row_reads_like_the_dict_it_replaced():
    from hvd_compress.tools import plan
    from hvd_compress.tools.runrow import ABSENT, COLUMNS, RunRow
    assert plan.COLUMNS == COLUMNS == list(SUMMARY_KEYS) + ADDED_COLUMNS + LATER_COLUMNS
    run = RunRow(**PLANNED)
    assert run == PLANNED and PLANNED == run and dict(run) == PLANNED and len(run) == 8
    assert (run.compression, run.np, run.bandwidth) == ("topk:ratio=0.01", 2, "1gbit")
    assert run["np"] == 2 and set(run) == set(PLANNED) and set(run.items()) == set(PLANNED.items())
    # a column it does not hold is missing, as the dict's key was
    assert "status" not in run and run.get("status") is None and run.get("status", "") == ""
    assert run.status is ABSENT and not run.status
    with pytest.raises(KeyError):
        run["status"]
    row = run.copy()
    row["status"] = "ok"
    row.images_per_sec = 12.5
    row["strategy"] = "horovod"  # a key outside the columns is kept as it came
    assert row == dict(PLANNED, status="ok", images_per_sec=12.5, strategy="horovod")
    assert row.others == {"strategy": "horovod"} and "status" not in run
    del row["status"], row["strategy"]
    assert row == dict(PLANNED, images_per_sec=12.5)
    with pytest.raises(KeyError):
        del row["status"]
    assert dict(run, status="ok") == dict(PLANNED, status="ok")  # what the tests' fakes build
    assert RunRow.of(PLANNED) == run and RunRow.of(run) is run and "RunRow(" in repr(run)


def test_planned_runs_are_run_rows_as_the_dicts_were():
    from hvd_compress.tools import compare as cmp
    from hvd_compress.tools.runrow import RunRow
    args = cmp.parser().parse_args(["--out", "x", "--example", "digits", "--compression", "none",
                                    "--np", "1", "2", "--bandwidth", "uncapped", "1gbit"])
    runs = cmp.plan_runs(args, capped_ok=True)
    assert all(type(r) is RunRow for r in runs)
    base = {"framework": "torch", "example": "digits", "compression": "none", "latency": "",
            "mode": "sync", "device": "cpu", "repeat": 1}
    assert runs == [dict(base, np=1, bandwidth="uncapped", nodes=1),
                    dict(base, np=2, bandwidth="uncapped", nodes=1),
                    dict(base, np=2, bandwidth="1gbit", nodes=1)]
    assert cmp.run_name(runs[2]) == "torch_digits_none_np2_1gbit"


def _old_write_csv(path, rows, columns):
    """0.2.8's report.write_csv, for the round trip's comparison."""
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def test_results_csv_round_trip_is_unchanged(tmp_path):
    """Rows written from RunRows give the same file as the dicts did, and read back
    (as RunRows) equal what csv.DictReader gave; written again, the same file."""
    import csv
    import json

    from hvd_compress.tools import report
    from hvd_compress.tools.runrow import RunRow
    ok = dict(PLANNED, status="ok", log="logs/a.log", steps=12, images_per_sec=812.25,
              images_per_sec_per_worker=406.12, bytes_per_step=1048, compute_ms=9.5,
              encode_ms=None, comm_ms=1.25, decode_ms=0.5, test_accuracy=0.9312, wall_s=14.2,
              step_ms=11.25, collectives_per_step=3.0, local_bytes_per_step=0,
              curve=json.dumps([{"epoch": 1, "seconds": 1.5, "test_accuracy": 0.9312}]),
              strategy="horovod")  # (not a column: left out of the file)
    failed = dict(PLANNED, compression="none", np=1, bandwidth="uncapped",
                  status="failed (exit 1); see logs/b.log", log="logs/b.log", wall_s=2.0)
    report.add_targets([ok, failed], 0.9)
    typed = [RunRow.of(r) for r in (ok, failed)]
    assert typed == [ok, failed]
    old, new = tmp_path / "old.csv", tmp_path / "results.csv"
    _old_write_csv(old, [ok, failed], list(SUMMARY_KEYS) + ADDED_COLUMNS + LATER_COLUMNS)
    report.write_csv(new, typed)
    assert new.read_text() == old.read_text()
    with open(old, newline="") as f:
        plain = list(csv.DictReader(f))
    back = report.read_csv(new)
    assert all(type(r) is RunRow for r in back) and back == plain
    assert back[0]["encode_ms"] == "" and back[0].time_to_target_s == "1.5" and back[1].curve == ""
    again = tmp_path / "again.csv"
    report.write_csv(again, back)
    assert again.read_text() == old.read_text()
