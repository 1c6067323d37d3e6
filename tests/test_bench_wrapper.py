"""scripts/bench_wrapper.py: the wrapper's per-step cost against TensorFlow's own
all-reduce (issue 37, part 6) -- its command line and its summary of the runs."""

import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = str(REPO / "scripts/bench_wrapper.py")


def test_help_names_the_variants_and_the_target():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert all(v in out.stdout for v in ("mwms", "horovod", "ours", "--json", "1.3"))


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--variant", "nccl"],
                                   ["--variant", "mwms", "--mode", "eager"]])
def test_bad_flags_are_usage_errors(flags):
    out = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "error:" in out.stderr


def test_summary_takes_medians_of_run_medians_and_ratios():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_wrapper
    doc = {"images_per_sec": 100.0, "load_average": 1.0}
    runs = {"mwms": [dict(doc, median_ms=m) for m in (10.0, 12.0, 11.0)],
            "horovod": [dict(doc, median_ms=m) for m in (20.0, 14.0, 16.0)],
            "ours": [dict(doc, median_ms=m) for m in (13.0, 15.0, 30.0)]}
    out = bench_wrapper.summarise(runs)
    assert [out[v]["median_ms"] for v in ("mwms", "horovod", "ours")] == [11.0, 16.0, 15.0]
    assert out["ours"]["ratio_to_mwms"] == round(15 / 11, 3)
    assert out["ours"]["ratio_to_horovod"] == round(15 / 16, 3)
