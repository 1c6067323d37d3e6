"""scripts/bench_wrapper.py: the wrapper's per-step cost against TensorFlow's own
all-reduce (issue 37, part 6) -- its command line and its summary of the runs."""

import statistics
import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = str(REPO / "scripts/bench_wrapper.py")


@pytest.fixture(scope="module")
def bench_wrapper():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_wrapper
    return bench_wrapper


def _runs(**medians) -> dict:
    """Per variant, one run document per repeat with these median step times."""
    doc = {"images_per_sec": 100.0, "load_average": 1.0}
    return {v: [dict(doc, median_ms=m) for m in ms] for v, ms in medians.items()}


def test_help_names_the_variants_and_the_target():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert all(v in out.stdout for v in ("mwms", "horovod", "ours", "--json", "1.3"))


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--variant", "nccl"],
                                   ["--variant", "mwms", "--mode", "eager"],
                                   ["--cycle-time", "0"]])
def test_bad_flags_are_usage_errors(flags):
    out = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "error:" in out.stderr


def test_summary_takes_medians_of_run_medians_and_ratios(bench_wrapper):
    runs = _runs(mwms=(10.0, 12.0, 11.0), horovod=(20.0, 14.0, 16.0), ours=(13.0, 15.0, 30.0))
    out = bench_wrapper.summarise(runs)
    assert [out[v]["median_ms"] for v in ("mwms", "horovod", "ours")] == [11.0, 16.0, 15.0]
    assert out["ours"]["ratio_to_mwms"] == round(15 / 11, 3)
    assert out["ours"]["ratio_to_horovod"] == round(15 / 16, 3)


def test_summary_pairs_each_repeat_with_its_baseline(bench_wrapper):
    # repeat 2 ran under load: every variant slower, the ratios within it unchanged
    runs = _runs(mwms=(10.0, 30.0, 10.0), horovod=(15.0, 45.0, 20.0), ours=(12.0, 36.0, 13.0))
    out = bench_wrapper.summarise(runs)
    assert out["mwms"]["paired_ratio_to_mwms"] == 1.0
    assert out["horovod"]["paired_ratio_to_mwms"] == 1.5
    assert out["ours"]["paired_ratio_to_mwms"] == 1.2
    assert out["ours"]["paired_ratio_to_horovod"] == round(statistics.median(
        [12 / 15, 36 / 45, 13 / 20]), 3)
    alone = bench_wrapper.summarise({"ours": runs["ours"], "local": runs["mwms"]})
    assert alone["ours"]["ratio_to_mwms"] is None and alone["ours"]["paired_ratio_to_mwms"] is None


def test_cycle_time_goes_to_the_horovod_launches_only(bench_wrapper):
    args = bench_wrapper.argparse.Namespace(steps=5, warmup=1, batch_size=16, lr=0.02, seed=0,
                                            mode="function", np=2, timeout=60.0, cycle_time=0.5)
    for variant in ("horovod", "ours", "local"):
        cmd = bench_wrapper._command(args, variant)
        assert cmd[cmd.index("--cycle-time-ms") + 1] == "0.5" and "hvd_compress.tools.hvdrun" in cmd
    assert "--cycle-time-ms" not in bench_wrapper._command(args, "mwms")
    args.cycle_time = None
    assert "--cycle-time-ms" not in bench_wrapper._command(args, "ours")
