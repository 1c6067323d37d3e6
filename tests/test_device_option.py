"""``--device cuda|cpu`` (issue 39): the examples and hvd-compress-compare refuse cuda where
the framework sees no GPU, at start-up and with one line; compare records the device in its
rows, passes it to every run and resumes by it; on a GPU an example trains there.

The refusals launch each script once, directly (no horovodrun): they must end before Horovod
starts or data loads.  The examples' summaries carry ``device`` in their own tests
(test_torch_examples.py, test_tensorflow_examples.py: the default device)."""

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hvd_compress.tools import devices
from tests.harness import REPO, run_script

NO_CUDA = not torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(not NO_CUDA, reason="PyTorch sees a GPU: nothing to refuse")
needs_cuda = pytest.mark.skipif(NO_CUDA, reason="no CUDA device on this machine")
TORCH_NO_GPU = "--device cuda: no CUDA device visible to PyTorch ("
TF_NO_GPU = "--device cuda: no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') is empty)"


def _check_refusal(proc, message):
    """Exit status 2; the last line of stderr ``message`` (one line, after the script's
    name) saying what to do instead; no traceback, no run."""
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in last and last.endswith("; use --device cpu"), proc.stderr
    assert "Traceback" not in proc.stderr and "summary:" not in proc.stdout, proc.stderr
    return proc


@needs_no_cuda
def test_the_torch_examples_and_compare_refuse_cuda_without_a_gpu(tmp_path):
    """Each of the three examples and compare once, side by side (each only imports)."""
    out = tmp_path / "never"
    argvs = [[REPO / "torch_examples" / script, "--device", "cuda"]
             for script in ("train_digits.py", "synthetic_benchmark.py")]
    # train_cifar10 is given no data: the device is refused before the data is read
    argvs.append([REPO / "torch_examples" / "train_cifar10.py", "--device", "cuda",
                  "--data-dir", tmp_path / "no-data"])
    argvs.append([REPO / "scripts" / "compare.py", "--out", out, "--device", "cuda", "--np", "1"])
    procs = [subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for argv in argvs]
    ended = [subprocess.CompletedProcess(argv, None, *proc.communicate(timeout=300))
             for argv, proc in zip(argvs, procs)]
    for done, proc in zip(ended, procs):
        done.returncode = proc.returncode
        _check_refusal(done, TORCH_NO_GPU)
    assert not out.exists()  # compare refused before making its folder


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="no TensorFlow here (the refusal without it: the test below)")
def test_a_tensorflow_example_refuses_cuda_without_a_gpu(tmp_path):
    argv = [REPO / "tf_examples" / "train_cifar10.py", "--device", "cuda", "--data-dir",
            tmp_path / "no-data"]
    proc = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    if proc.returncode == 1 and "data_batch_1 not found" in proc.stderr:
        pytest.skip("TensorFlow sees a GPU: nothing to refuse (the example went on to the data)")
    _check_refusal(proc, TF_NO_GPU)


def test_a_framework_that_does_not_import_is_one_line_not_a_traceback(monkeypatch):
    """``--device cuda`` (or the default) for a framework missing here: a ValueError that
    :func:`devices.choose` turns into the example's one-line exit, not ModuleNotFoundError."""
    def missing(framework):
        raise ModuleNotFoundError(f"No module named {framework!r}")

    monkeypatch.setattr(devices, "gpu_count", missing)
    with pytest.raises(ValueError, match=r"^--device cuda: TensorFlow does not import here "
                                         r"\(No module named 'tensorflow'\); install it"):
        devices.resolve("cuda", "tensorflow")
    with pytest.raises(ValueError, match="^TensorFlow does not import here"):
        devices.resolve(None, "tensorflow")
    assert devices.resolve("cpu", "tensorflow") == "cpu"


def test_the_default_device_follows_what_the_framework_sees(monkeypatch):
    seen = {"torch": 2, "tensorflow": 0}
    monkeypatch.setattr(devices, "gpu_count", lambda framework: seen[framework])
    assert devices.resolve(None, "torch") == devices.resolve("cuda", "torch") == "cuda"
    assert devices.resolve(None, "tensorflow") == devices.resolve("cpu", "torch") == "cpu"
    assert devices.resolve(None, ["torch", "tensorflow"]) == "cpu"  # all of them, or none
    with pytest.raises(ValueError, match="no GPU visible to TensorFlow"):
        devices.resolve("cuda", ["torch", "tensorflow"])
    with pytest.raises(ValueError, match="one of cuda, cpu"):
        devices.resolve("gpu", "torch")
    # each worker on GPU local_rank % GPUs: workers beyond the GPUs share them
    assert [devices.gpu_index(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [devices.gpu_index(r, 1) for r in range(3)] == [0, 0, 0]


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_compare_records_the_device_passes_it_and_resumes_by_it(monkeypatch, tmp_path, capsys):
    """Nothing launched: execute() is replaced by a fake that records each run's example
    command and returns its row; the GPUs the frameworks see are made up."""
    from hvd_compress.tools import compare as cmp
    gpus = {"n": 0}
    monkeypatch.setattr(devices, "gpu_count", lambda framework: gpus["n"])
    commands = []

    def fake(args, run, out):
        commands.append(cmp.example_command(args, run, Path("r.json")))
        return dict(run, status="ok", images_per_sec=1.0, step_ms=1.0, log="x", steps=1)
    monkeypatch.setattr(cmp, "execute", fake)
    monkeypatch.setattr(cmp, "plot", lambda *a, **k: [])  # (test_compare.py draws them)
    base = ["--out", str(tmp_path), "--compression", "none", "--np", "2", "--bandwidth",
            "uncapped", "--quiet"]

    def flag(cmd):
        return cmd[cmd.index("--device") + 1]

    # no GPU: the default is cpu, in the row and on the example's command line
    assert cmp.main(base) == 0 and [flag(c) for c in commands] == ["cpu"]
    assert [r["device"] for r in _rows(tmp_path)] == ["cpu"]
    assert "| device |" not in (tmp_path / "results.md").read_text()
    # a GPU: the default is cuda, and the cpu row does not stand for the cuda run
    gpus["n"] = 1
    commands.clear()
    capsys.readouterr()
    assert cmp.main(base + ["--resume"]) == 0 and [flag(c) for c in commands] == ["cuda"]
    assert "results.csv holds runs on cpu, kept beside these in the tables" in capsys.readouterr().out
    assert [r["device"] for r in _rows(tmp_path)] == ["cuda", "cpu"]
    md = (tmp_path / "results.md").read_text()
    assert "| np | device | bandwidth |" in md and "| 2 | cuda | uncapped |" in md
    assert "| 2 | cpu | uncapped |" in md
    # each is compared with none on its own device: both rows are the baseline of their own
    assert md.count("| 1.00x |") == 2
    run = cmp.plan_runs(cmp.parser().parse_args(base + ["--device", "cuda"]), capped_ok=False)[0]
    assert run.device == "cuda" and cmp.run_name(run).endswith("_uncapped_cuda")
    assert cmp.run_key(run) != cmp.run_key(dict(run, device="cpu"))
    # both done: resuming either device runs nothing
    commands.clear()
    for device in ("cuda", "cpu"):
        assert cmp.main(base + ["--device", device, "--resume"]) == 0
    assert commands == []
    # results written before --device have no device column: their rows ran on the CPU
    rows = [r for r in _rows(tmp_path) if r["device"] == "cpu"]
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in cmp.COLUMNS if c != "device"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    assert cmp.main(base + ["--device", "cpu", "--resume"]) == 0 and commands == []
    assert cmp.main(base + ["--device", "cuda", "--resume"]) == 0
    assert [flag(c) for c in commands] == ["cuda"]


def test_compare_refuses_device_in_the_example_args(tmp_path, capsys):
    from hvd_compress.tools import compare as cmp
    with pytest.raises(SystemExit) as stop:
        cmp.main(["--out", str(tmp_path / "never"), "--example-args", "--epochs 1 --device cpu"])
    assert stop.value.code == 2 and "give compare's --device" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


@needs_cuda
@pytest.mark.multiprocess
def test_an_example_trains_on_the_gpu(tmp_path):
    """The digits on GPU 0 at np 1: model, data, gradients and the top-k compressor's state
    (its residual) on the device; the summary says where, the accuracy is a number."""
    out = tmp_path / "s.json"
    run_script("torch_examples/train_digits.py", ["--device", "cuda", "--compression",
                                                  "topk:ratio=0.01", "--epochs", "2", "--json",
                                                  out, "--quiet"], np=1, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["device"].startswith("cuda") and doc["np"] == 1, doc
    assert math.isfinite(doc["test_accuracy"]) and 0.0 <= doc["test_accuracy"] <= 1.0, doc
    assert doc["bytes_per_step"] > 0 and doc["steps"] == 2 * (1437 // 16), doc
