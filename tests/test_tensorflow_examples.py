"""TensorFlow examples and the Keras optimizer under real horovodrun -np 2 launches.

The example runs under Horovod share one launch (tests/workers/examples.py runs the
scripts' ``main`` one after another in the same workers, with the resumes of the
checkpoint test): a launch costs about 12 s before a script's first step."""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from hvd_compress.tools import devices
from hvd_compress.tools.runtools import SUMMARY_KEYS
from tests.harness import REPO, run_horovod, run_many, write_cifar_batches
from tests.launches import TF_GLOO, TF_MPI

pytestmark = pytest.mark.multiprocess

CKPT_SPECS = ["topk:ratio=0.1", "onebit", "powersgd:rank=2", "dgc:ratio=0.1"]
# the checkpoint test's first halves run in the np 2 MPI launch other modules share
# (tests.launches), before the examples' launch, which resumes them under Gloo
_CKPT = tempfile.mkdtemp(prefix="hvd-test-keras-ckpt-")
atexit.register(shutil.rmtree, _CKPT, True)
TF_MPI.add(__name__, "ckpt", "tests.workers.tf_tape:keras_checkpoint_phases",
           {"specs": CKPT_SPECS, "path": _CKPT, "phase": "run"})
# a ResNet of one stage, 8 wide (the checks read the summary, not the model's size: tracing
# and the eager sample of the split cost per layer)
SMALL_RESNET = ["--width", "8", "--blocks", "1"]
SYNTHETIC = ["--num-iters", "2", "--num-batches-per-iter", "2", "--batch-size", "8",
             "--num-warmup-batches", "1", *SMALL_RESNET]
# our tape (with backward passes per step) and Horovod's; a third run of our tape
# without them checked nothing these two do not (the test budget)
SYNTHETIC_EXTRA = [["--compression", "onebit", "--backward-passes-per-step", "2"],
                   ["--compression", "fp16", "--horovod-tape"]]
# local SGD averages after every 4th of 135 updates, and once more before evaluating;
# DGA sends every update
LOCAL_FLAGS = [(["--local-sgd", "--backward-passes-per-step", "4"], (135 // 4 + 1) / 135),
               (["--delay", "2"], 1.0)]
# {key: (script, arguments before --json)}: every example run under Horovod that the tests read
RUNS = {
    # at most 7 epochs, ending after the first at 90% (--stop-at; seen: 95.3%, 96.9% after 7)
    **{f"digits-{spec}": ("train_digits.py", ["--compression", spec, "--epochs", "7",
                                              "--stop-at", "0.9", "--quiet"])
       for spec in ["topk:ratio=0.01", "dgc:ratio=0.001"]},  # the rest: scripts/accuracy.py
    "bpps": ("train_digits.py", ["--compression", "topk:ratio=0.05", "--epochs", "2",
                                 "--backward-passes-per-step", "2"]),
    # three epochs (seen: 96.4% and 96.1%; 98.1% and 97.8% after six)
    **{f"local-{i}": ("train_digits.py", [*flags, "--epochs", "3", "--quiet"])
       for i, (flags, _) in enumerate(LOCAL_FLAGS)},
    "stop-at": ("train_digits.py", ["--local-sgd", "--backward-passes-per-step", "4", "--epochs",
                                    "4", "--stop-at", "0.2", "--quiet"]),
    "synthetic-local-sgd": ("synthetic_benchmark.py", [*SYNTHETIC, "--local-sgd",
                                                       "--backward-passes-per-step", "2", "--quiet"]),
    **{f"synthetic-{i}": ("synthetic_benchmark.py", [*SYNTHETIC, *extra])
       for i, extra in enumerate(SYNTHETIC_EXTRA)},
    "cifar10": ("train_cifar10.py", ["--data-dir", "{cifar}", "--epochs", "1", "--batch-size", "8",
                                     "--compression", "dgc:ratio=0.01", *SMALL_RESNET, "--quiet"]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request):
    """One np 2 Gloo launch: every run of RUNS (``{key: per-rank {"out", "doc"}}``, the
    summary in rank 0's), then the checkpoint test's resumes (``"resumed"``: per-rank
    results) of the first halves that the shared MPI launch ran before it (``"ckpt"``)."""
    full = TF_MPI.results(request, "ckpt")  # (launches it, if no test has yet)
    tmp = tmp_path_factory.mktemp("tf-examples")
    cifar = tmp / "cifar"
    cifar.mkdir()
    write_cifar_batches(cifar, images=16)
    runs = [[key, script, [str(a).format(cifar=cifar) for a in args] + ["--json", str(tmp / f"{key}.json")]]
            for key, (script, args) in RUNS.items()]
    got = run_many(run_horovod, [
        ("runs", "tests.workers.examples:run", {"folder": "tf_examples", "runs": runs}),
        ("resumed", "tests.workers.tf_tape:keras_checkpoint_phases",
         {"specs": CKPT_SPECS, "path": _CKPT, "phase": "resume"})], np=2, controller="gloo",
        timeout=1800)
    return {**{key: [rank[key] for rank in got["runs"]] for key in RUNS},
            "ckpt": full, "resumed": got["resumed"]}


def summary(launched, key) -> dict:
    return launched[key][0]["doc"]


def default_device() -> str:
    """The summary's device of a run without --device: cuda where TensorFlow sees a GPU
    (rank 0's is GPU 0), else cpu."""
    return {"cuda": "cuda:0", "cpu": "cpu"}[devices.resolve(None, "tensorflow")]


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.001"])
def test_keras_fit_digits_reaches_90_percent(spec, launched):
    doc = summary(launched, f"digits-{spec}")
    assert set(SUMMARY_KEYS) <= set(doc) and doc["framework"] == "tensorflow" and doc["np"] == 2
    assert doc["test_accuracy"] >= 0.90, doc
    if spec != "none":
        assert doc["bytes_per_step"] < 153_128 / 2


@pytest.fixture(scope="module")
def keras_bpps_doc(launched):
    return summary(launched, "bpps")


def test_keras_backward_passes_per_step(keras_bpps_doc):
    doc = keras_bpps_doc
    assert doc["steps"] == (2 * 45) // 2  # 45 batches of 16 per epoch on each rank, 2 per update
    assert doc["device"] == default_device(), doc
    # the accuracy curve: one point per epoch (the last after training), in the training
    # seconds images/s counts (evaluation left out)
    curve = doc["curve"]
    assert [p["epoch"] for p in curve] == [1, 2] and 0 < curve[0]["seconds"] < curve[1]["seconds"]
    assert curve[-1]["test_accuracy"] == doc["test_accuracy"]
    images = doc["steps"] * 32 * 2
    assert curve[-1]["seconds"] == pytest.approx(images / doc["images_per_sec"], rel=0.02)


def test_keras_traced_run_reports_its_time_split(keras_bpps_doc):
    """Issue 37: a traced Keras step's encode / comm / decode are measured (on an eager
    sample after training), never reported as 0.0; the step time is the summary's own."""
    doc = keras_bpps_doc
    assert doc["split_measured"].startswith("eager sample: 5 exchanges"), doc
    assert all(doc[k] > 0 for k in ("encode_ms", "comm_ms", "decode_ms")), doc
    assert doc["step_ms"] == pytest.approx(1e3 * doc["curve"][-1]["seconds"] / doc["steps"],
                                           rel=0.01, abs=0.01)
    split = doc["encode_ms"] + doc["comm_ms"] + doc["decode_ms"]
    assert doc["compute_ms"] == pytest.approx(max(0.0, doc["step_ms"] - split), abs=0.01)
    # and the bytes over a worker's links, from the same sample (2 workers: what it sends)
    assert doc["wire_in_per_step"] == doc["wire_out_per_step"] > 0, doc
    assert doc["wire_in_per_step"] == pytest.approx(doc["bytes_per_step"], rel=0.05), doc


@pytest.mark.parametrize("run", range(len(LOCAL_FLAGS)),
                         ids=["local-sgd", "dga"])
def test_keras_fit_digits_with_local_sgd_and_dga(run, launched):
    flags, bytes_ratio = LOCAL_FLAGS[run]
    doc = summary(launched, f"local-{run}")
    assert doc["test_accuracy"] >= 0.90, doc
    assert doc["steps"] == 3 * 45  # one update per batch in both
    assert doc["bytes_per_step"] == pytest.approx(153_128 * bytes_ratio, rel=0.01)
    assert doc["local_sgd"] == ("--local-sgd" in flags)


def test_keras_fit_stops_at_the_target_on_every_worker(launched):
    """--stop-at A ends fit after the first epoch that reaches A (rank 0 decides), under
    local SGD too; the summary counts no final average, which did not run."""
    doc = summary(launched, "stop-at")
    assert doc["epochs"] == 1 and [p["epoch"] for p in doc["curve"]] == [1], doc
    assert doc["steps"] == 45 and doc["test_accuracy"] == doc["curve"][0]["test_accuracy"] >= 0.2
    assert doc["bytes_per_step"] == pytest.approx(153_128 * 11 / 45, rel=0.01)  # 11 averages
    images = doc["steps"] * 16 * 2
    assert doc["curve"][0]["seconds"] == pytest.approx(images / doc["images_per_sec"], rel=0.02)


def test_synthetic_tape_with_local_sgd(launched):
    doc = summary(launched, "synthetic-local-sgd")
    assert doc["local_sgd"] and doc["steps"] == 4 and doc["bytes_per_step"] > 0


WARMUP_SPEC = "dgc:ratio=0.01,warmup_epochs=2"


# DGC's warm-up under Keras fit runs in the np 2 Gloo launch other modules share
# (tests.launches)
TF_GLOO.add(__name__, "warmup", "tests.workers.tf_tape:keras_dgc_warmup", {"spec": WARMUP_SPEC})
TF_GLOO.add(__name__, "all_workers", "tests.workers.tf_tape:examples_all_workers", {"late_s": 0.3})


def test_the_examples_meet_around_an_evaluation_without_spinning(request):
    """Before an evaluation (timed) the training time becomes the slowest worker's; the
    wait leaves the CPU to the workers still training (tests/test_torch_waiting.py has the
    PyTorch examples' barrier)."""
    first = TF_GLOO.results(request, "all_workers")[0]
    assert first["wall_s"] > 0.2, first  # rank 0 waited for rank 1
    assert first["cpu_s"] < 0.1 * first["wall_s"], first


def test_keras_optimizer_checkpoint_resumes_identically(launched):
    """The compressors' first halves in the shared np 2 MPI launch, the resumes in the
    examples' launch (Gloo: a checkpoint does not depend on the controller that wrote it).
    The compressors' state is keyed by the variables' names, which Keras numbers per
    process: each phase clears Keras's global state before building its models."""
    full, resumed = launched["ckpt"], launched["resumed"]
    for spec in CKPT_SPECS:
        for a, b in zip(full, resumed):
            assert a[spec]["params"] == b[spec]["params"], spec
            assert a[spec]["iterations"] == b[spec]["iterations"] == 6, spec
        assert full[0][spec]["params"] == full[1][spec]["params"], spec


@pytest.mark.parametrize("name", ["train_digits.py", "synthetic_benchmark.py", "train_cifar10.py"])
def test_help_and_bad_spec(name):
    script = str(REPO / "tf_examples" / name)
    ok = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "--compression" in ok.stdout and "--json" in ok.stdout
    bad = subprocess.run([sys.executable, script, "--compression", "qsgd:levels=0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "qsgd: levels must be >= 1, got 0" in bad.stderr


def test_tf_train_cifar10_reads_python_batches(launched):
    doc = summary(launched, "cifar10")
    assert doc["example"] == "train_cifar10" and 0.0 <= doc["test_accuracy"] <= 1.0
    assert doc["steps"] == 40 // 8  # 80 training images, 40 per rank


def test_tf_train_cifar10_missing_data_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tf_examples" / "train_cifar10.py"),
                           "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "data_batch_1 not found" in proc.stderr


@pytest.mark.parametrize("run", range(len(SYNTHETIC_EXTRA)),
                         ids=["our-tape", "horovod-tape"])
def test_tf_synthetic_benchmark(run, launched):
    extra = SYNTHETIC_EXTRA[run]
    assert "total img/sec on 2 workers" in launched[f"synthetic-{run}"][0]["out"]
    doc = summary(launched, f"synthetic-{run}")
    assert set(SUMMARY_KEYS) <= set(doc) and doc["steps"] == 4 and doc["test_accuracy"] is None
    assert doc["bytes_per_step"] > 0 and doc["device"] == default_device(), doc
    split = [doc[k] for k in ("encode_ms", "comm_ms", "decode_ms")]
    if "--horovod-tape" in extra:  # Horovod's own tape keeps no account: null, not 0.0
        assert split == [None] * 3 and doc["split_measured"].startswith("not measured")
    else:  # the traced tape's split, measured on a sample, and its bytes over the links:
        # at 2 workers an allgather's and a ring allreduce's are what a worker sends
        assert all(v > 0 for v in split) and doc["split_measured"].startswith("eager sample")
        assert doc["wire_in_per_step"] == doc["wire_out_per_step"] > 0, doc
        assert doc["wire_in_per_step"] == pytest.approx(doc["bytes_per_step"], rel=0.05), doc


def test_keras_dgc_warmup_callback_retraces_when_the_density_changes(request):
    """A traced step keeps the payload sizes of its trace: CompressionWarmupCallback traces it again
    when DGC's density changes; a bare set_epoch leaves the stale trace and warns."""
    from hvd_compress.core import build
    core = build(WARMUP_SPEC)
    per_epoch = []
    for epoch in range(4):
        core.set_epoch(epoch)
        per_epoch.append(sum(core.payload_nbytes(core.meta_for(np.zeros(s, np.float32), n))
                             for n, s in (("k", (30, 40)), ("b", (40,)), ("k2", (40, 4)),
                                          ("b2", (4,)))))
    assert per_epoch[0] > per_epoch[1] > per_epoch[2] == per_epoch[3]
    for rank in TF_GLOO.results(request, "warmup"):
        assert rank["callback"] == {"bytes": per_epoch, "warned": False}, rank
        assert rank["plain"]["bytes"] == [per_epoch[0]] * 4 and rank["plain"]["warned"], rank


def test_mwms_baseline_trains_two_workers_with_the_examples_summary(tmp_path, keras_bpps_doc):
    """Issue 19: TensorFlow's MultiWorkerMirroredStrategy (no Horovod) trains the digits
    (here the 10.8M-parameter MLP of --model wide) on the same shards, two workers
    launched with TF_CONFIG by hvd_compress.tools.mwms, to completion; its summary has
    the Horovod run's keys."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "hvd_compress.tools.mwms", "-np", "2",
                           "--timeout", "300", sys.executable, str(REPO / "tf_examples/train_digits.py"),
                           "--strategy", "mwms", "--model", "wide", "--batch-size", "64",
                           "--epochs", "1", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc) == set(keras_bpps_doc)
    assert doc["strategy"] == "mwms" and keras_bpps_doc["strategy"] == "horovod"
    assert doc["device"] == default_device()
    assert doc["np"] == 2 and doc["steps"] == 12 and doc["compression"] == "none"
    assert doc["bytes_per_step"] == 4 * 10_780_170  # the wide MLP, dense float32
    # TensorFlow's all-reduce has no split to read: null, with the reason, never 0.0
    assert [doc[k] for k in ("encode_ms", "comm_ms", "decode_ms")] == [None] * 3
    assert doc["split_measured"].startswith("not measured") and doc["compute_ms"] == doc["step_ms"]
    assert [p["epoch"] for p in doc["curve"]] == [1] and doc["test_accuracy"] > 0.5
    assert "after 1 epochs" in proc.stdout and proc.stdout.count("summary:") == 1


def test_mwms_stops_at_the_target_on_every_worker(tmp_path):
    """--stop-at under MWMS: rank 0's answer reaches the other worker through the
    strategy's all-reduce, and both leave the loop after that epoch."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "hvd_compress.tools.mwms", "-np", "2",
                           "--timeout", "300", sys.executable, str(REPO / "tf_examples/train_digits.py"),
                           "--strategy", "mwms", "--epochs", "3", "--stop-at", "0.2", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["epochs"] == 1 and doc["steps"] == 45 and [p["epoch"] for p in doc["curve"]] == [1]
    assert doc["test_accuracy"] == doc["curve"][0]["test_accuracy"] >= 0.2
    assert "epoch 1: test accuracy" in proc.stdout and "after 1 epochs" in proc.stdout


def test_mwms_refuses_what_it_cannot_do():
    script = str(REPO / "tf_examples/train_digits.py")
    bad = subprocess.run([sys.executable, script, "--strategy", "mwms", "--compression", "topk"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "use --compression none" in bad.stderr
    alone = subprocess.run([sys.executable, script, "--strategy", "mwms"], cwd=REPO,
                           capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})
    assert alone.returncode != 0 and "needs TF_CONFIG" in alone.stdout + alone.stderr
