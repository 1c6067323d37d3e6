"""scripts/ablation.py: the DGC ablation table (one real, tiny launch; the rest by hand)."""

import csv
import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = str(REPO / "scripts/ablation.py")
sys.path.insert(0, str(REPO / "scripts"))
import ablation  # noqa: E402


def _row(fw, method, ratio, seed, acc, status="ok"):
    return {"framework": fw, "method": method, "ratio": ratio, "compression": method,
            "seed": seed, "test_accuracy": acc, "status": status}


def test_cells_verdict_and_markdown():
    rows = [_row("torch", "none", "", s, a) for s, a in enumerate((0.99, 0.98, 0.97))]
    for method, accs in (("gradient dropping", (0.80, 0.84)),
                         ("top-k + error feedback", (0.97, 0.97)),
                         ("DGC", (0.975, 0.98))):
        rows += [_row("torch", method, "0.001", s, a) for s, a in enumerate(accs)]
    rows.append(_row("torch", "DGC", "0.001", 2, None, "failed (exit 1)"))
    table = ablation.cells(rows)
    dgc = next(c for c in table if c["method"] == "DGC")
    assert dgc["mean"] == pytest.approx(97.75) and dgc["failed"] == 1
    assert dgc["spread"] == pytest.approx(0.3536, abs=1e-4)
    (line,) = ablation.verdict(table, ["torch"], [0.001])
    assert "80.00" not in line and "82.00 < top-k+EF 97.00 <= DGC 97.75: yes" in line
    assert "within 1 point of none (98.00): yes" in line
    text = ablation.markdown(table, 15, 2)
    assert "| torch | 0.001 | DGC | `DGC` | 97.75 ± 0.35 | 97.5, 98.0 (1 failed) |" in text


def test_plan_and_bad_arguments(tmp_path):
    args = ablation.parser().parse_args(["--out", str(tmp_path), "--framework", "torch",
                                         "--methods", "none", "DGC", "--seeds", "0", "1"])
    runs = ablation.plan(args)
    assert [(r["method"], r["compression"], r["seed"]) for r in runs] == [
        ("none", "none", 0), ("none", "none", 1),
        ("DGC", "dgc:ratio=0.001", 0), ("DGC", "dgc:ratio=0.001", 1),
        ("DGC", "dgc:ratio=0.01", 0), ("DGC", "dgc:ratio=0.01", 1)]
    bad = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--ratios", "2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "(0, 1]" in bad.stderr
    assert "gradient dropping" in subprocess.run([sys.executable, SCRIPT, "--help"],
                                                 capture_output=True, text=True).stdout


@pytest.mark.multiprocess
def test_one_real_launch(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--framework", "torch",
                           "--methods", "DGC", "--ratios", "0.01", "--seeds", "0", "--epochs", "1",
                           "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "ablation.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["compression"] == "dgc:ratio=0.01" and row["status"] == "ok"
    assert 0.0 < float(row["test_accuracy"]) <= 1.0
    assert "| torch | 0.01 | DGC |" in (tmp_path / "ablation.md").read_text()
