"""scripts/accuracy.py: every compressor's digits accuracy and speed beside none (the
table by hand; one real, tiny launch)."""

import csv
import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = str(REPO / "scripts/accuracy.py")
sys.path.insert(0, str(REPO / "scripts"))
import accuracy  # noqa: E402


def _row(fw, spec, seed, acc, ips=1000.0, status="ok"):
    return {"framework": fw, "compression": spec, "seed": seed, "test_accuracy": acc,
            "images_per_sec": ips, "bytes_per_step": 100, "status": status}


def test_table_markdown_and_verdict():
    rows = [_row("torch", "none", s, a, 1000.0) for s, a in enumerate((0.99, 0.98))]
    rows += [_row("torch", "topk", s, a, 800.0) for s, a in enumerate((0.98, 0.975))]
    rows += [_row("torch", "qsgd", s, a) for s, a in enumerate((0.96, 0.97))]
    rows.append(_row("torch", "qsgd", 2, None, None, "failed (exit 1)"))
    cells = accuracy.table(rows)
    qsgd = next(c for c in cells if c["compression"] == "qsgd")
    assert qsgd["mean"] == pytest.approx(96.5) and qsgd["failed"] == 1
    lines = accuracy.verdict(cells)
    topk = next(line for line in lines if line.startswith("torch topk"))
    assert "97.75 vs none 98.50 -> within 0.5 points: NO" in topk
    assert "images/s 0.80x none (target >= 0.7): yes" in topk
    assert any("torch qsgd: 96.50 vs none 98.50 -> within 1 point: NO" in x for x in lines)
    args = accuracy.parser().parse_args(["--out", "x"])
    text = accuracy.markdown(cells, args)
    assert "| torch | `topk` | 97.75 ± 0.35 (98.0, 97.5) | -0.75 | 100 | 800 | 0.80x |" in text


def test_defaults_and_bad_arguments(tmp_path):
    assert accuracy.default_specs()[0] == "none" and "dgc" in accuracy.default_specs()
    bad = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--specs", "nosuch"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown compressor" in bad.stderr
    assert "images/s" in subprocess.run([sys.executable, SCRIPT, "--help"],
                                        capture_output=True, text=True).stdout


@pytest.mark.multiprocess
def test_one_real_launch(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--framework", "torch",
                           "--specs", "topk", "--seeds", "0", "--epochs", "1", "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "accuracy.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["compression"] for r in rows] == ["none", "topk"]
    assert all(r["status"] == "ok" and 0 < float(r["test_accuracy"]) <= 1 for r in rows)
    assert "torch topk:" in proc.stdout
