"""``hvd-compress-compare --repeat N``: the matrix run N times, every run kept in
results.csv, the tables and the cost model on each setting's medians."""

import csv
import json

import pytest

from hvd_compress.tools import compare
from hvd_compress.tools.plan import repeat_of, run_key, run_name
from hvd_compress.tools.repeats import TIMED, medians

BASE = ["--example", "digits", "--compression", "none", "topk:ratio=0.01", "--np", "2",
        "--bandwidth", "uncapped", "--quiet"]


def _rows(path):
    with open(path / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _fake(launched, fail=()):
    """An execute that records each launch and reports a step time that grows with the
    repetition (1: 100 ms, 2: 300 ms, 3: 200 ms) and a compute share of it."""
    step = {1: 100.0, 2: 300.0, 3: 200.0, 4: 400.0}

    def execute(args, run, out):
        k = repeat_of(run)
        launched.append((run["compression"], k))
        if (run["compression"], k) in fail:
            return dict(run, status="failed: exit 1; see x.log", log="x.log")
        ms = step[k] + (10.0 if run["compression"] == "none" else 0.0)
        return dict(run, status="ok", images_per_sec=1e4 / ms, images_per_sec_per_worker=5e3 / ms,
                    step_ms=ms, compute_ms=ms / 2, encode_ms=1.0, comm_ms=ms / 2 - 1.0,
                    decode_ms=0.0, bytes_per_step=4000 if run["compression"] == "none" else 80,
                    log="x.log", steps=3, wall_s=ms / 100, test_accuracy=0.9 + k / 100,
                    curve=json.dumps([{"epoch": 1, "seconds": ms / 1e3, "test_accuracy": 0.9}]))
    return execute


def test_the_plan_repeats_the_whole_matrix_and_names_each_repetition():
    args = compare.parser().parse_args(["--out", "x", *BASE, "--repeat", "3"])
    runs = compare.plan_runs(args, True)
    once = compare.plan_runs(compare.parser().parse_args(["--out", "x", *BASE]), True)
    assert len(once) == 2 and len(runs) == 6
    assert [repeat_of(r) for r in runs] == [1, 1, 2, 2, 3, 3]  # the matrix, then again
    assert len({run_key(r) for r in runs}) == 6 and len({run_name(r) for r in runs}) == 6
    assert [run_name(r) for r in runs[:2]] == [run_name(r) for r in once]  # repetition 1: as before
    assert run_name(runs[4]).endswith("_r3")
    # a row of a results.csv written before the column is repetition 1 of its run
    old = {k: v for k, v in runs[0].items() if k != "repeat"}
    assert run_key(old) == run_key(runs[0])


def test_medians_take_each_column_over_the_successful_repetitions():
    rows = [{"compression": "a", "np": "2", "status": "ok", "repeat": str(k), "step_ms": str(s),
             "compute_ms": str(c), "bytes_per_step": "7", "curve": f"c{k}", "encode_ms": e}
            for k, s, c, e in ((1, 100, 90, "1.0"), (2, 300, 10, "2.0"), (3, 200, 50, ""))]
    rows.append({"compression": "a", "np": "2", "status": "failed", "repeat": "4"})
    rows.append({"compression": "b", "np": "2", "status": "failed", "repeat": "1"})
    rows.append({"compression": "c", "np": "2", "status": "ok", "repeat": "1", "step_ms": "5"})
    got = medians(rows)
    assert [r["compression"] for r in got] == ["a", "b", "c"]
    a = got[0]
    assert a["repeats"] == 3 and a["repeat"] == "3"  # the run whose step time is the median
    assert (a["step_ms"], a["compute_ms"], a["curve"]) == (200.0, 50.0, "c3")
    assert a["encode_ms"] == "" and a["bytes_per_step"] == "7"  # not every repetition measured it
    assert got[1]["status"] == "failed"  # nothing succeeded: the failure shows
    assert dict(got[2].items()) == rows[-1]  # one run: itself
    assert {"compute_ms", "encode_ms", "comm_ms", "decode_ms", "step_ms"} <= set(TIMED)


def test_a_repeated_matrix_end_to_end_with_a_failure_resume_and_the_prediction(monkeypatch, tmp_path):
    launched, seen = [], []
    monkeypatch.setattr(compare, "execute", _fake(launched, fail={("topk:ratio=0.01", 2)}))
    real = compare.predict
    monkeypatch.setattr(compare, "predict", lambda rows, *a: seen.append(rows) or real(rows, *a))
    out = ["--out", str(tmp_path), *BASE, "--predict"]
    assert compare.main(out + ["--repeat", "3"]) == 0
    assert launched == [("none", 1), ("topk:ratio=0.01", 1), ("none", 2), ("topk:ratio=0.01", 2),
                        ("none", 3), ("topk:ratio=0.01", 3)]
    rows = _rows(tmp_path)
    assert [(r["compression"], r["repeat"], r["status"][:6]) for r in rows] == [
        ("none", "1", "ok"), ("topk:ratio=0.01", "1", "ok"), ("none", "2", "ok"),
        ("topk:ratio=0.01", "2", "failed"), ("none", "3", "ok"), ("topk:ratio=0.01", "3", "ok")]
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("Each row is the median of its setting's successful runs")
    assert "Fewer than 3 succeeded for: topk:ratio=0.01 np 2 uncapped." in md
    table = [line for line in md.splitlines() if line.startswith("| torch")]
    assert len(table) == 2  # a row a setting
    assert "| 47.6 |" in table[0]  # none: 1e4 / 210 ms, the median of 110, 310, 210
    assert "| 75.0 |" in table[1]  # top-k: repetitions 1 and 3 (100, 50 images/s): their mean
    (fitted,) = seen
    assert len(fitted) == 2 and sorted(float(r["compute_ms"]) for r in fitted) == [75.0, 105.0]
    assert (tmp_path / "prediction.md").exists()
    # resumed with one more repetition: only its runs (and the failed one) are launched
    launched.clear()
    monkeypatch.setattr(compare, "execute", _fake(launched))
    assert compare.main(out + ["--repeat", "4", "--resume"]) == 0
    assert sorted(launched) == [("none", 4), ("topk:ratio=0.01", 2), ("topk:ratio=0.01", 4)]
    assert "Fewer than" not in (tmp_path / "results.md").read_text()
    launched.clear()
    assert compare.main(out + ["--repeat", "4", "--resume"]) == 0 and launched == []


def test_repeat_below_one_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        compare.main(["--out", str(tmp_path / "o"), *BASE, "--repeat", "0"])
    assert stop.value.code == 2 and "--repeat must be 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
