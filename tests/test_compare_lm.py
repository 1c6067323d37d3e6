"""compare with the language model (issue 40): ``--example lm``, the optimizer axis (AdamW
with every compressor and mode, 1-bit Adam and 0/1 Adam a row each per setting), DiLoCo
modes, a target validation loss, resume keyed by optimizer, the example's summary read into
its row -- nothing launched (the example itself: tests/test_lm_example.py)."""

import csv
import json
import subprocess
from pathlib import Path

import pytest

from hvd_compress.tools import compare as cmp
from hvd_compress.tools import report
from tests.harness import REPO

MATRIX = ["--example", "lm", "--np", "1", "4", "--nodes", "2", "--bandwidth", "200mbit",
          "--compression", "none", "topk:ratio=0.01", "--optimizer", "adamw", "onebit-adam",
          "zeroone-adam", "--diloco", "50", "--modes-for", "none", "--target-loss", "2.5"]


def _flag(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_the_issue_table_is_one_matrix_with_each_method_and_its_flags():
    """Dense AdamW, top-k 1% with error feedback under AdamW, DiLoCo H=50, 1-bit Adam and
    0/1 Adam in one matrix, each launched with the example flags it needs."""
    args = cmp.parser().parse_args(["--out", "x", *MATRIX])
    runs = cmp.plan_runs(args, capped_ok=True)
    got = {(r["optimizer"], r["compression"], r["mode"], r["np"]) for r in runs}
    assert got == {("adamw", "none", "sync", 1), ("adamw", "none", "sync", 4),
                   ("adamw", "none", "DiLoCo H=50", 4),
                   ("adamw", "topk:ratio=0.01", "sync", 1), ("adamw", "topk:ratio=0.01", "sync", 4),
                   ("adamw", "topk:ratio=0.01", "flat", 4),
                   ("onebit-adam", "efsignsgd", "two-phase", 4),
                   ("zeroone-adam", "efsignsgd", "two-phase", 4)}
    assert len(runs) == len(got)
    assert len({cmp.run_key(r) for r in runs}) == len({cmp.run_name(r) for r in runs}) == len(runs)
    assert "optimizer" in cmp.RUN_KEYS
    by = {(r["optimizer"], r["mode"], r["np"], r["compression"]): r for r in runs}
    for r in runs:
        cmd = cmp.example_command(args, r, Path("r.json"))
        assert cmd[1].endswith("torch_examples/train_lm.py")
        assert _flag(cmd, "--optimizer") == r["optimizer"] and _flag(cmd, "--target-loss") == "2.5"
        assert "--stop-at-target" not in cmd and "--stop-at" not in cmd
    one = cmp.example_command(args, by[("onebit-adam", "two-phase", 4, "efsignsgd")], Path("r.json"))
    assert (_flag(one, "--compression"), _flag(one, "--exchange")) == ("efsignsgd", "two-phase")
    diloco = cmp.example_command(args, by[("adamw", "DiLoCo H=50", 4, "none")], Path("r.json"))
    assert _flag(diloco, "--diloco") == "50" and "--local-sgd" not in diloco
    assert cmp.method(by[("zeroone-adam", "two-phase", 4, "efsignsgd")]) == \
        "zeroone-adam: efsignsgd (two-phase)"
    assert cmp.method(by[("adamw", "DiLoCo H=50", 4, "none")]) == "none (DiLoCo H=50)"
    assert cmp.method(by[("adamw", "sync", 4, "none")]) == "none"
    assert cmp.run_name(by[("onebit-adam", "two-phase", 4, "efsignsgd")]) == \
        "torch_lm_onebit-adam_efsignsgd_two-phase_np4_2nodes_200mbit"
    # only the Adam-family methods: no AdamW rows; --adam-compression picks their compressor
    args = cmp.parser().parse_args(["--out", "x", "--example", "lm", "--np", "2", "--bandwidth",
                                    "uncapped", "--optimizer", "onebit-adam", "--adam-compression",
                                    "onebit", "--stop-at-target", "--target-loss", "2"])
    runs = cmp.plan_runs(args, capped_ok=True)
    assert [(r["optimizer"], r["compression"], r["mode"]) for r in runs] == [
        ("onebit-adam", "onebit", "two-phase")]
    cmd = cmp.example_command(args, runs[0], Path("r.json"))
    assert _flag(cmd, "--target-loss") == "2" and "--stop-at-target" in cmd
    # Streaming DiLoCo's fragments are part of the mode; the other examples' rows have no optimizer
    assert cmp.mode_flags(cmp.diloco_mode(8, 4)) == ["--diloco", "8", "--fragments", "4"]
    assert cmp.run_modes(diloco=[8], fragments=4) == ["sync", "DiLoCo H=8 F=4"]
    digits = cmp.plan_runs(cmp.parser().parse_args(["--out", "x", "--example", "digits", "--np", "2",
                                                    "--bandwidth", "uncapped"]), capped_ok=True)
    assert all("optimizer" not in r for r in digits)
    assert all("--optimizer" not in cmp.example_command(args, r, Path("r.json")) for r in digits)
    # TensorFlow's folder lacks the language model, and need not hold it
    from hvd_compress.tools.run import scripts_of
    assert "train_lm.py" not in scripts_of("tensorflow") and "train_lm.py" in scripts_of("torch")
    assert cmp.examples_dir("tensorflow") == REPO / "tf_examples"


@pytest.mark.parametrize("flags, message", [
    (["--example", "digits", "--optimizer", "onebit-adam"],
     "--optimizer chooses the optimizers of --example lm"),
    (["--example", "digits", "--diloco", "50"], "--diloco runs with --example lm"),
    (["--example", "lm", "--fragments", "4"], "--fragments needs --diloco H"),
    (["--example", "lm", "--diloco", "50", "--optimizer", "onebit-adam"], "add it to --optimizer"),
    (["--example", "digits", "--target-loss", "2"], "reports a validation loss (--example lm)"),
    (["--example", "lm", "--target-loss", "0"], "--target-loss is a validation loss > 0"),
    (["--example", "lm", "--target-accuracy", "0.9"], "--target-loss L"),
    (["--example", "lm", "--framework", "tensorflow"], "PyTorch's only"),
    (["--example", "lm", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["--example", "lm", "--stop-at-target"], "--stop-at-target needs --target-accuracy A"),
    (["--example", "lm", "--compression", "powersgd:rank=2", "--diloco", "0"], "must be >= 1"),
    (["--example", "lm", "--diloco", "50", "--fragments", "4"], "must be a multiple of fragments (4)"),
])
def test_what_the_language_model_alone_runs_is_refused_elsewhere(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cmp.main(["--out", str(tmp_path / "out"), "--quiet", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_resume_keys_rows_by_optimizer_and_the_table_times_the_target_loss(monkeypatch, tmp_path):
    launched = []
    finals = {"adamw": [3.0, 2.4, 2.2], "onebit-adam": [2.9, 2.45, 2.3], "zeroone-adam": [3.1, 2.8, 2.6]}

    def fake(args, run, out):
        launched.append((run["optimizer"], run["compression"], run["mode"]))
        losses = [3.2, 2.6, 2.3] if run["mode"].startswith("DiLoCo") else finals[run["optimizer"]]
        dense = run["optimizer"] == "adamw" and run["mode"] == "sync"
        seconds = [2.0, 4.0, 6.0] if dense else [1.0, 2.0, 3.0]
        curve = [{"step": 50 * (i + 1), "seconds": t, "val_loss": v, "train_loss": v + 0.1}
                 for i, (t, v) in enumerate(zip(seconds, losses))]
        return dict(run, status="ok", images_per_sec=1000.0, tokens_per_sec=1000.0, step_ms=1.0, log="x",
                    steps=150, val_loss=losses[-1], curve=json.dumps(curve))
    monkeypatch.setattr(cmp, "execute", fake)
    base = ["--out", str(tmp_path), "--example", "lm", "--compression", "none", "--np", "2",
            "--bandwidth", "uncapped", "--quiet", "--target-loss", "2.5"]
    assert cmp.main(base) == 0 and launched == [("adamw", "none", "sync")]
    # results written before the optimizer column: their rows read as "" (no choice), so an
    # lm row without it is not taken for AdamW's -- here the column is kept
    launched.clear()
    assert cmp.main(base + ["--optimizer", "adamw", "onebit-adam", "zeroone-adam", "--diloco", "50",
                            "--resume"]) == 0
    assert launched == [("adamw", "none", "DiLoCo H=50"), ("onebit-adam", "efsignsgd", "two-phase"),
                        ("zeroone-adam", "efsignsgd", "two-phase")]
    rows = _rows(tmp_path)
    assert [(r["optimizer"], r["mode"]) for r in rows] == [
        ("adamw", "sync"), ("adamw", "DiLoCo H=50"), ("onebit-adam", "two-phase"),
        ("zeroone-adam", "two-phase")]
    got = {r["optimizer"] + " " + r["mode"]: (r["time_to_target_s"], r["steps_to_target"], r["best_loss"],
                                              r["target_loss"], r["target_accuracy"]) for r in rows}
    assert got == {"adamw sync": ("4.0", "100", "2.2", "2.5", ""),
                   "adamw DiLoCo H=50": ("3.0", "150", "2.3", "2.5", ""),
                   "onebit-adam two-phase": ("2.0", "100", "2.3", "2.5", ""),
                   "zeroone-adam two-phase": ("", "", "2.6", "2.5", "")}
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("Target validation loss 2.5:")
    assert "| optimizer |" in md and "| tokens/s |" in md and "| val loss |" in md
    assert "| steps to target |" in md and "missed (best 2.6000)" in md
    assert "fastest to 2.5 at np 2, uncapped: onebit-adam: efsignsgd (two-phase) -- 2.00 s, 100 step(s), " \
           "2.00x sooner than none (4.00 s)" in md, md
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "accuracy_curves.png").exists()
    # a row from before the optimizer column is keyed "" (not an lm row of this version)
    old = {k: v for k, v in rows[0].items() if k != "optimizer"}
    assert cmp.run_key(old) != cmp.run_key(rows[0])
    assert cmp.run_key(old)[cmp.RUN_KEYS.index("optimizer")] == ""
    assert report.best_loss(dict(rows[0], curve="")) == 2.2  # no curve: its last loss


def test_a_language_model_summary_is_read_back_into_its_row(monkeypatch, tmp_path):
    """execute() reads what train_lm.py's summary holds (its keys: tests/test_lm_example.py)
    into the run's row: loss, tokens/s, the loss curve; the launch is recorded, not run."""
    args = cmp.parser().parse_args(["--out", str(tmp_path), "--example", "lm", "--np", "2",
                                    "--bandwidth", "uncapped", "--compression", "none"])
    [run] = cmp.plan_runs(args, capped_ok=True)
    curve = [{"step": 4, "seconds": 0.5, "val_loss": 4.1, "train_loss": 5.0},
             {"step": 8, "seconds": 1.0, "val_loss": 3.6, "train_loss": 3.9}]
    doc = {"framework": "torch", "example": "train_lm", "compression": "none", "np": 2, "steps": 8,
           "images_per_sec": 2048.0, "tokens_per_sec": 2048.0, "step_ms": 125.0, "bytes_per_step": 9000,
           "parameters": 2000, "val_loss": 3.6, "train_loss": 3.9, "optimizer": "adamw", "curve": curve,
           "loss_per_step": [5.5] * 8, "time_to_target_s": None, "target_loss": None}
    launched = []

    class Proc:
        pid, returncode = 0, 0

        def __init__(self, argv, **kw):
            launched.append(argv)
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(doc))

        def poll(self):
            return 0
    monkeypatch.setattr(subprocess, "Popen", Proc)
    row = report.add_targets([cmp.execute(args, run, tmp_path)], 3.8, report.LOSS)[0]
    assert launched and launched[0][launched[0].index("--optimizer") + 1] == "adamw"
    assert (row["status"], row["optimizer"], row["example"]) == ("ok", "adamw", "lm")  # (its key, kept)
    assert (row["tokens_per_sec"], row["val_loss"], row["parameters"]) == (2048.0, 3.6, 2000)
    assert json.loads(row["curve"]) == curve and "loss_per_step" not in row
    assert (row["time_to_target_s"], row["steps_to_target"], row["best_loss"]) == (1.0, 8, 3.6)
