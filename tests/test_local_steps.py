"""Local SGD and Delayed Gradient Averaging (hvd_compress.localsteps), PyTorch optimizer.

Multi-process checks run under real ``horovodrun -np 2`` against trajectories
computed by hand in numpy (tests/workers/local_steps.py).
"""

import numpy as np
import pytest

from hvd_compress import spec as specmod
from hvd_compress.localsteps import LocalSGDSchedule, check_local_args, check_wrapper_args
from tests.launches import TORCH_GLOO
from tests.workers.local_hand import check_local_log


def test_schedule_warmup_then_every_period():
    s = LocalSGDSchedule(period=4, warmup=3)
    assert [s.synchronous(i) for i in range(5)] == [True, True, True, False, False]
    assert [i for i in range(20) if s.averages_after(i)] == [6, 10, 14, 18]
    assert [i for i in range(9) if LocalSGDSchedule(1).averages_after(i)] == list(range(9))


def test_schedule_works_on_tf_integer_tensors():
    tf = pytest.importorskip("tensorflow")
    s = LocalSGDSchedule(period=3, warmup=2)
    got = [bool(s.averages_after(tf.constant(i, tf.int64))) for i in range(10)]
    assert got == [s.averages_after(i) for i in range(10)]
    assert bool(s.synchronous(tf.constant(1, tf.int64))) and not bool(s.synchronous(tf.constant(2)))


@pytest.mark.parametrize("kwargs, message", [
    ({"local_sgd": True, "delay": 2}, "cannot be combined"),
    ({"delay": -1}, "delay must be an integer >= 0"),
    ({"delay": 1.5}, "delay must be an integer >= 0"),
    ({"warmup": 3}, "needs local_sgd=True"),
    ({"local_sgd": True, "warmup": -1}, "must be >= 0"),
    ({"local_sgd": True, "op_is_average": False}, "need op=Average"),
    ({"delay": 2, "backward_passes_per_step": 2}, "backward_passes_per_step=1"),
    ({"delay": 1, "spec": specmod.parse("powersgd:rank=2")}, "one-round compressor"),
])
def test_bad_combinations_are_clear_errors(kwargs, message):
    args = {"local_sgd": False, "backward_passes_per_step": 1, "warmup": 0, "delay": 0,
            "op_is_average": True, "spec": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_local_args(**args)


@pytest.mark.parametrize("spec", ["none", "qsgd:sum=int", "terngrad:sum=int,ef=true",
                                  "signsgd:sum=int", "topk:ratio=0.1+qsgd", "randomk+fp16",
                                  "dgc:ratio=0.01+onebit", "dgc:dense=true", "onebit"])
def test_delay_takes_every_compressor_whose_rounds_are_not_chained(spec):
    """Only PowerSGD's rounds are chained; the integer sums' two rounds, compositions and
    the dense DGC a per-tensor plan sends its small tensors with go with DGA."""
    check_local_args(False, 1, 0, 2, True, specmod.parse(spec))


def test_ops_other_than_average_or_sum_go_with_none_only():
    args = ("w", "h", False, False, 1.0, 1, False, 0, 0)
    check_wrapper_args(*args, [specmod.parse("none")], op_sums=False)
    check_wrapper_args(*args, [specmod.parse("topk")], op_sums=True)
    for spec in ("fp16", "topk", "powersgd", "qsgd:sum=int", "dgc:dense=true", "randomk+fp16"):
        with pytest.raises(ValueError, match="op must be Average or Sum"):
            check_wrapper_args(*args, [specmod.parse("none"), specmod.parse(spec)], op_sums=False)


# Every multi-process case below runs in one launch, with other modules' np 2 bodies
# (tests.launches): launching costs seconds; the cases each build their own model and optimizer.
LOCAL_SGD = [("none", 4, 0, 12), ("none", 2, 3, 12), ("fp16", 4, 0, 12),  # spec, period, warmup, steps
             ("topk:ratio=0.4", 4, 0, 8), ("onebit", 4, 0, 8), ("powersgd:rank=1", 4, 0, 8)]
DGA = [("none", 2, 8), ("none", 0, 5), ("topk:ratio=0.4", 2, 7)]  # spec, delay, steps


def _key(kind, *args):
    return ":".join(map(str, (kind, *args)))


for _c in LOCAL_SGD:
    TORCH_GLOO.add(__name__, _key("local_sgd", *_c), "tests.workers.local_steps:local_sgd",
                   dict(zip(("spec", "period", "warmup", "steps"), _c)))
for _c in DGA:
    TORCH_GLOO.add(__name__, _key("dga", *_c), "tests.workers.local_steps:dga",
                   dict(zip(("spec", "delay", "steps"), _c)))


@pytest.fixture(scope="module")
def logs(request):
    """Per case key, the per-rank logs of the launch that ran every case."""
    return _Logs(request)


class _Logs:
    def __init__(self, request):
        self.request = request

    def __getitem__(self, key):
        return TORCH_GLOO.results(self.request, key)


def test_torch_optimizer_rejects_bad_combinations():
    torch = pytest.importorskip("torch")
    import hvd_compress.torch as hc
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="one-round compressor"):
        hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(),
                                compression="powersgd:rank=1", delay=2, min_numel=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec, period, warmup, exact", [
    ("none", 4, 0, 1e-5),      # the exact mean of the ranks' parameters
    ("none", 2, 3, 1e-5),      # post-local SGD: 3 synchronous steps first
    ("fp16", 4, 0, 5e-3),      # changes since the last average, sent as fp16
])
def test_local_sgd_matches_the_hand_computed_average(spec, period, warmup, exact, logs):
    steps = 12
    results = logs[_key("local_sgd", spec, period, warmup, steps)]
    check_local_log(results, period, warmup, steps, exact)


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", ["topk:ratio=0.4", "onebit", "powersgd:rank=1"])
def test_compressed_local_sgd_ranks_agree_after_each_average(spec, logs):
    steps, period = 8, 4
    results = logs[_key("local_sgd", spec, period, 0, steps)]
    check_local_log(results, period, 0, steps, exact=np.inf)
    # between averages a worker's parameters are exactly its own SGD steps
    for rank, log in enumerate(results):
        assert np.abs(np.array(log[0]["params"][rank]) - log[0]["hand"]).max() < 1e-5


@pytest.mark.multiprocess
def test_dga_matches_the_hand_computed_correction(logs):
    delay, steps = 2, 8
    results = logs[_key("dga", "none", delay, steps)]
    for log in results:
        for step, entry in enumerate(log):
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5, step
            assert entry["collectives"] > 0  # every step sends, nobody waits for it
        # the delayed path is not synchronous training
        assert np.abs(np.array(log[-1]["params"]) - log[-1]["sync"]).max() > 1e-3
    assert results[0][-1]["params"] != results[1][-1]["params"]  # local corrections differ


@pytest.mark.multiprocess
def test_dga_with_delay_zero_is_synchronous_training_exactly(logs):
    results = logs[_key("dga", "none", 0, 5)]
    for log in results:
        for entry in log:
            assert entry["params"] == entry["sync"]  # bit-identical to Horovod's optimizer
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5
    assert results[0][-1]["params"] == results[1][-1]["params"]


@pytest.mark.multiprocess
def test_dga_with_a_compressor_runs_and_ranks_send_alike(logs):
    results = logs[_key("dga", "topk:ratio=0.4", 2, 7)]
    for log in results:
        # the first `delay` steps are purely local, as in the hand computation
        for entry in log[:2]:
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5
        assert all(np.isfinite(entry["params"]).all() for entry in log)
        # every step, past D too: g_i - g_{i-D} + the top-k exchange's average of g_{i-D}
        # (numpy, the residuals carried in step order)
        for step, entry in enumerate(log):
            assert np.abs(np.array(entry["params"]) - entry["hand_compressed"]).max() < 1e-5, step
        assert np.abs(np.array(log[-1]["params"]) - log[-1]["hand"]).max() > 1e-4  # compressed
    assert [e["collectives"] for e in results[0]] == [e["collectives"] for e in results[1]]


def test_local_steps_table_script(tmp_path):
    import csv
    import subprocess
    import sys

    from tests.harness import REPO
    script = str(REPO / "scripts/local_steps_table.py")
    assert "local SGD" in subprocess.run([sys.executable, script, "--help"], capture_output=True,
                                         text=True, check=True).stdout
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--periods", "--delays"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "at least one" in bad.stderr
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--epochs", "1",
                           "--periods", "2", "--delays", "0", "1", "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "local_steps.csv") as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"sync", "DGA D=1", "local SGD H=2"}
    assert all(r["status"] == "ok" for r in rows.values())
    sync = int(rows["sync"]["bytes_per_epoch"])
    assert int(rows["DGA D=1"]["bytes_per_epoch"]) == sync
    assert int(rows["local SGD H=2"]["bytes_per_epoch"]) == sync // 2  # 44 steps, 22 averages
    assert "| local SGD H=2 |" in (tmp_path / "local_steps.md").read_text()
    with open(tmp_path / "torch" / "results.csv") as f:  # compare's own results, curves included
        runs = {r["mode"]: r for r in csv.DictReader(f)}
    assert set(runs) == set(rows) and all(r["example"] == "digits" and r["curve"] for r in runs.values())
    assert runs["local SGD H=2"]["test_accuracy"] == rows["local SGD H=2"]["test_accuracy"]


def _preset():
    import importlib.util

    from tests.harness import REPO
    spec = importlib.util.spec_from_file_location("local_steps_table", REPO / "scripts/local_steps_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_steps_table_is_a_preset_of_compare(tmp_path, capsys):
    from hvd_compress.tools import compare
    preset = _preset()
    args = preset.parser().parse_args(["--out", str(tmp_path), "--periods", "2", "4", "--delays", "0", "3",
                                       "--epochs", "3", "--compression", "none", "fp16", "--quiet"])
    got = compare.parser().parse_args(preset.compare_argv(args, "tensorflow", tmp_path))
    assert (got.example, got.framework, got.np, got.bandwidth) == ("digits", "tensorflow", [2], ["uncapped"])
    assert (got.compression, got.example_args, got.out) == (["none", "fp16"], "--epochs 3",
                                                            str(tmp_path / "tensorflow"))
    assert compare.run_modes(got.local_sgd, got.delay) == ["sync", "DGA D=3", "local SGD H=2",
                                                           "local SGD H=4"]
    only_sync = preset.parser().parse_args(["--out", "x", "--periods", "--delays", "0"])
    argv = preset.compare_argv(only_sync, "torch", tmp_path)
    assert "--local-sgd" not in argv and "--delay" not in argv
    # a compare row becomes a table row: bytes per epoch from bytes per step
    row = preset.table_row(args, {"framework": "torch", "compression": "none", "mode": "local SGD H=2",
                                  "status": "ok", "steps": "132", "bytes_per_step": "76564",
                                  "test_accuracy": "0.95", "images_per_sec": "100", "wall_s": "3"})
    assert row["bytes_per_epoch"] == 76564 * 132 // 3 and row["mode"] == "local SGD H=2"
    assert preset.table_row(args, {"framework": "torch", "compression": "none", "status": "failed",
                                   "test_accuracy": ""})["mode"] == "sync"
    # DGA with PowerSGD: refused before anything is launched
    with pytest.raises(SystemExit) as stop:
        preset.main(["--out", str(tmp_path / "o"), "--compression", "powersgd:rank=2", "--delays", "2",
                     "--periods"])
    assert stop.value.code == 2 and "one-round compressor" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
