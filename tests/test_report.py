"""A comparison's results from rows made up here, nothing launched: time to accuracy,
results.md, the accuracy curves (hvd_compress.tools.report)."""

import json

from hvd_compress.tools import plan, report, runtools


def made_up_row(spec, np_, bw, mode="sync", ips=100.0, curve=None, status="ok"):
    """A successful results.csv row as compare reads it back (strings; the curve as JSON),
    ``curve`` as [(seconds, accuracy), ...] per epoch."""
    row = {"framework": "torch", "example": "digits", "compression": spec, "np": str(np_),
           "bandwidth": bw, "latency": "", "mode": mode, "status": status, "log": "x",
           "images_per_sec": str(ips), "images_per_sec_per_worker": str(ips / np_), "step_ms": "10",
           "bytes_per_step": "1000", "wall_s": "9"}
    if curve is not None and status == "ok":
        row["curve"] = json.dumps([{"epoch": i + 1, "seconds": t, "test_accuracy": a}
                                   for i, (t, a) in enumerate(curve)])
        row["test_accuracy"] = str(curve[-1][1])
    return row


def test_time_to_target_is_the_first_curve_point_at_or_above_it():
    curve = [(1.5, 0.7), (3.0, 0.9), (4.5, 0.85), (6.0, 0.95)]
    rows = [made_up_row("none", 2, "uncapped", curve=curve),
            made_up_row("fp16", 2, "uncapped", curve=[(1.0, 0.5), (2.0, 0.89)]),
            made_up_row("topk:ratio=0.01", 2, "uncapped", status="failed (exit 1); see x"),
            made_up_row("onebit", 2, "uncapped")]  # no curve: an example without accuracy
    report.add_targets(rows, 0.9)
    none, fp16, failed, nocurve = rows
    # reached at exactly the target, at the second epoch (the dip after it does not matter)
    assert (none["time_to_target_s"], none["epochs_to_target"], none["best_accuracy"]) == (3.0, 2, 0.95)
    assert (fp16["time_to_target_s"], fp16["epochs_to_target"], fp16["best_accuracy"]) == ("", "", 0.89)
    assert report.missed(fp16, 0.9) and not report.missed(none, 0.9)
    for r in (failed, nocurve):
        assert r["time_to_target_s"] == r["epochs_to_target"] == "" and not report.missed(r, 0.9)
    assert failed["best_accuracy"] == nocurve["best_accuracy"] == ""
    assert {r["target_accuracy"] for r in rows} == {0.9}
    # a new target: recomputed from the curves; none: blank
    report.add_targets(rows, 0.7)
    assert (none["epochs_to_target"], fp16["epochs_to_target"]) == (1, 2)
    report.add_targets(rows, None)
    assert none["time_to_target_s"] == none["target_accuracy"] == "" and none["best_accuracy"] == 0.95
    # the columns reach results.csv and come back
    assert {"mode", "target_accuracy", "time_to_target_s", "epochs_to_target", "best_accuracy",
            "curve"} <= set(plan.COLUMNS)
    assert plan.COLUMNS[:len(runtools.SUMMARY_KEYS)] == list(runtools.SUMMARY_KEYS)
    assert report.reach([], 0.5) is None


def _setting_rows():
    """np 1 and np 2 uncapped, np 2 at 1gbit: at np 2 uncapped local SGD reaches 0.9 soonest,
    DGA never; at 1gbit no run reaches it."""
    return [
        made_up_row("none", 1, "uncapped", ips=50, curve=[(4.0, 0.8), (8.0, 0.92)]),
        made_up_row("none", 2, "uncapped", ips=100, curve=[(5.0, 0.85), (10.0, 0.91)]),
        made_up_row("none", 2, "uncapped", "local SGD H=4", ips=200, curve=[(1.5, 0.8), (3.0, 0.93)]),
        made_up_row("none", 2, "uncapped", "DGA D=2", ips=110, curve=[(4.0, 0.8), (8.0, 0.85)]),
        made_up_row("topk:ratio=0.01", 2, "uncapped", ips=150, curve=[(3.0, 0.88), (6.0, 0.9)]),
        made_up_row("none", 2, "1gbit", ips=40, curve=[(9.0, 0.8), (18.0, 0.86)]),
        made_up_row("topk:ratio=0.01", 2, "1gbit", ips=120, curve=[(3.0, 0.85), (6.0, 0.87)]),
        made_up_row("topk:ratio=0.01", 2, "1gbit", "DGA D=2", status="failed (exit 1); see y"),
    ]


def test_results_md_names_the_fastest_to_the_target_and_reports_misses(tmp_path):
    rows = _setting_rows()
    path = tmp_path / "results.md"
    report.write_markdown(path, report.add_targets(rows, 0.9), 0.9)
    md = path.read_text()
    assert md.startswith("Target test accuracy 0.9:")
    table = [line for line in md.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:4] == ["framework", "example", "compression", "mode"]
    assert head[-4:] == ["to target s", "epochs to target", "wall s", "status"]
    cells = {(c[2], c[3], c[4], c[5]): dict(zip(head, c)) for c in
             ([x.strip() for x in line.strip("|").split("|")] for line in table[1:])}
    assert len(cells) == len(rows)
    lsgd = cells[("`none`", "local SGD H=4", "2", "uncapped")]
    assert (lsgd["to target s"], lsgd["epochs to target"]) == ("3.00", "2")
    assert lsgd["vs none"] == "2.00x"  # against none in sync mode, not another none
    assert cells[("`topk:ratio=0.01`", "sync", "2", "uncapped")]["vs none"] == "1.50x"
    dga = cells[("`none`", "DGA D=2", "2", "uncapped")]
    assert (dga["to target s"], dga["epochs to target"]) == ("missed (best 0.8500)", "")
    failed = cells[("`topk:ratio=0.01`", "DGA D=2", "2", "1gbit")]
    assert failed["to target s"] == "" and failed["status"] == "failed (exit 1)"
    lines = [line[2:] for line in md.splitlines() if line.startswith("- ")]
    assert lines == [
        "best at np 2, 1gbit: topk:ratio=0.01 -- 120.0 images/s, 3.00x none",
        "best at np 2, uncapped: none (local SGD H=4) -- 200.0 images/s, 2.00x none",
        "fastest to 0.9 at np 1, uncapped: none -- 8.00 s, 2 epoch(s)",
        "no run reached 0.9 at np 2, 1gbit; the best accuracy was topk:ratio=0.01's 0.8700",
        "fastest to 0.9 at np 2, uncapped: none (local SGD H=4) -- 3.00 s, 2 epoch(s), "
        "3.33x sooner than none (10.00 s)",
    ]
    # the fastest method when none itself never gets there
    rows[1]["curve"] = json.dumps([{"epoch": 1, "seconds": 5.0, "test_accuracy": 0.5}])
    assert report.target_lines(rows, 0.9)[2].endswith("2 epoch(s); none missed it (best 0.5000)")


def test_results_md_without_target_or_modes_is_as_before(tmp_path):
    rows = [r for r in _setting_rows() if r["mode"] == "sync"]
    for r in rows:
        del r["mode"]  # as in a results.csv written before modes existed
    path = tmp_path / "results.md"
    report.write_markdown(path, rows)
    md = path.read_text()
    assert md.startswith("| framework | example | compression | np | bandwidth | images/s | per worker | "
                         "vs none | bytes/step | compute ms | encode ms | comm ms | decode ms | accuracy | "
                         "wall s | status |\n")
    assert "target" not in md and "fastest" not in md and "best at np 2, uncapped: topk" in md


def test_accuracy_curves_one_panel_per_np_and_bandwidth(tmp_path):
    rows = _setting_rows()
    panels = report.curve_panels(rows)
    assert list(panels) == [(1, "uncapped"), (2, "uncapped"), (2, "1gbit")]
    assert [plan.method(r) for r in panels[(2, "uncapped")]] == [
        "none", "none (local SGD H=4)", "none (DGA D=2)", "topk:ratio=0.01"]
    assert len(panels[(2, "1gbit")]) == 2  # the failed run has no line
    written = report.plot(tmp_path, rows, 0.9)
    assert str(tmp_path / "accuracy_curves.png") in written
    assert (tmp_path / "accuracy_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.curve_panels([made_up_row("none", 2, "uncapped")]) == {}  # synthetic: no curves
