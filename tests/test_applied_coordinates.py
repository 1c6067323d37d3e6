"""scripts/applied_coordinates.py: the coordinates a step that reach the model, allgather
against two-phase, on simulated ranks (numpy core, no launch)."""

import csv
import json
import math
import subprocess
import sys

import pytest

from tests.harness import REPO

sys.path.insert(0, str(REPO / "scripts"))
import applied_coordinates  # noqa: E402

SIZES = {"conv2.weight": 16 * 32 * 9, "fc1.weight": 32 * 4 * 4 * 64}


def test_two_phase_applies_the_owners_k_and_the_allgather_the_union(tmp_path):
    out = tmp_path / "rows.csv"
    rows = applied_coordinates.main(["--np", "4", "--epochs", "3", "--specs", "topk:ratio=0.01",
                                     "--out", str(out)])
    by = {r["exchange"]: r for r in rows}
    assert set(by) == {"allgather", "two-phase"}
    for name, n in SIZES.items():
        owners = 4 * math.ceil(0.01 * n / 4)  # each owner re-selects ceil(ratio |chunk|)
        assert by["two-phase"][f"applied:{name}"] == pytest.approx(owners / n, abs=1e-5)
        union = by["allgather"][f"applied:{name}"]
        assert 2 * owners / n < union <= 4 * math.ceil(0.01 * n) / n, (name, union)
    for r in rows:
        assert 0.3 < r["test_accuracy"] <= 1.0  # well above chance (0.1) after three epochs
        assert len(r["curve"].split()) == 3
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert [w["exchange"] for w in written] == ["allgather", "two-phase"]
    assert float(written[1]["applied:fc1.weight"]) == by["two-phase"]["applied:fc1.weight"]


def test_help_and_bad_arguments():
    script = str(REPO / "scripts/applied_coordinates.py")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "two-phase" in done.stdout and "--np" in done.stdout
    with pytest.raises(SystemExit, match="at least 2"):
        applied_coordinates.main(["--np", "1"])
    for bad in (["--specs", "nosuch"], ["--specs", "topk:ratio=2"], ["--epochs", "0"]):
        done = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True)
        assert done.returncode == 2 and "error: argument" in done.stderr, (bad, done.stderr)
        assert "Traceback" not in done.stderr
    with pytest.raises(SystemExit, match="summable or pass-through"):
        applied_coordinates.main(["--np", "2", "--epochs", "1", "--specs", "fp16"])
    dense = applied_coordinates.main(["--np", "2", "--epochs", "1", "--specs", "none"])
    assert [r["exchange"] for r in dense] == ["dense"]  # the baseline: every tensor averaged
    assert not [k for k in dense[0] if k.startswith("applied:")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.01"])
def test_the_simulation_follows_the_example(tmp_path, spec):
    """The simulated ranks see what ``horovodrun -np 4 train_digits.py`` sees (split, initial
    weights, order, two-phase aggregate): the same test accuracy after each epoch, to within
    three test images (Horovod sums in another order, and while the accuracy climbs steeply
    a rounding moves a few images; another order of the data moves dozens)."""
    from tests.harness import run_script
    summary = tmp_path / "run.json"
    run_script("torch_examples/train_digits.py",
               ["--compression", spec, "--exchange", "two-phase", "--epochs", "3", "--seed", "5",
                "--quiet", "--json", summary], np=4)
    with open(summary) as f:
        real = [c["test_accuracy"] for c in json.load(f)["curve"]]
    row = applied_coordinates.run(4, spec, "two-phase", 5, 3)
    simulated = [float(a) for a in row["curve"].split()]
    assert len(real) == 3 and real[0] != real[-1]
    assert simulated == pytest.approx(real, abs=3.01 / 360), (simulated, real)
