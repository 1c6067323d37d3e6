"""The PyTorch examples, launched for real under horovodrun -np 2.

The runs share one launch (tests/workers/examples.py runs the scripts' ``main`` one
after another in the same workers): a launch costs seconds before a script's first step."""


import pytest

from hvd_compress.tools import devices
from hvd_compress.tools.runtools import SUMMARY_KEYS
from tests.harness import run_horovod, run_scripts_in_one_process, write_cifar_batches

pytestmark = pytest.mark.multiprocess
SCRIPTS = ["torch_examples/train_digits.py", "torch_examples/synthetic_benchmark.py",
           "torch_examples/train_cifar10.py"]
LOCAL_FLAGS = [(["--local-sgd", "--backward-passes-per-step", "4"], 1 / 4),  # averages every 4th step
               (["--delay", "2"], 1.0)]  # DGA sends every step, applies it 2 steps later
SYNTHETIC_EXTRA = [[], ["--horovod-optimizer"]]
# {key: (script, arguments before --json)}: every example run under Horovod that the tests read
RUNS = {
    # at most 7 epochs, ending after the first at 90% (--stop-at; seen: 97.5%, 94.2% after 7)
    **{f"digits-{spec}": ("train_digits.py", ["--compression", spec, "--epochs", "7",
                                              "--stop-at", "0.9", "--quiet"])
       for spec in ["topk:ratio=0.01", "dgc:ratio=0.001"]},  # the rest: scripts/accuracy.py
    "bpps": ("train_digits.py", ["--compression", "topk:ratio=0.05", "--backward-passes-per-step",
                                 "2", "--epochs", "2"]),
    "stop-at": ("train_digits.py", ["--local-sgd", "--backward-passes-per-step", "4", "--epochs",
                                    "4", "--stop-at", "0.2", "--quiet"]),
    "wide": ("train_digits.py", ["--model", "wide", "--batch-size", "64", "--epochs", "1"]),
    # six epochs (seen: 95.0% both)
    **{f"local-{i}": ("train_digits.py", [*flags, "--epochs", "6", "--quiet"])
       for i, (flags, _) in enumerate(LOCAL_FLAGS)},
    **{f"synthetic-{i}": ("synthetic_benchmark.py", ["--num-iters", "2", "--num-batches-per-iter",
                                                     "2", "--batch-size", "8", "--compression",
                                                     "fp16", *extra])
       for i, extra in enumerate(SYNTHETIC_EXTRA)},
    "cifar10": ("train_cifar10.py", ["--data-dir", "{cifar}", "--epochs", "2", "--batch-size", "8",
                                     "--compression", "dgc:ratio=0.01", "--quiet"]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every run of RUNS in one np 2 Gloo launch: ``{key: per-rank {"out", "doc"}}`` (what
    the run printed; its summary in rank 0's)."""
    tmp = tmp_path_factory.mktemp("torch-examples")
    cifar = tmp / "cifar"
    cifar.mkdir()
    write_cifar_batches(cifar, images=24)
    runs = [[key, script, [str(a).format(cifar=cifar) for a in args] + ["--json", str(tmp / f"{key}.json")]]
            for key, (script, args) in RUNS.items()]
    got = run_horovod("tests.workers.examples:run", np=2, controller="gloo", timeout=1800,
                      kwargs={"folder": "torch_examples", "runs": runs})
    return {key: [rank[key] for rank in got] for key in RUNS}


def _summary(launched, key):
    doc = launched[key][0]["doc"]
    assert set(SUMMARY_KEYS) <= set(doc)
    assert doc["framework"] == "torch" and doc["np"] == 2
    # where rank 0 trained: the default device (cuda where PyTorch sees a GPU: rank 0's is GPU 0)
    assert doc["device"] == {"cuda": "cuda:0", "cpu": "cpu"}[devices.resolve(None, "torch")], doc
    return doc


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.001"])
def test_train_digits_reaches_90_percent(spec, launched):
    doc = _summary(launched, f"digits-{spec}")
    assert doc["compression"] == spec and doc["example"] == "train_digits"
    assert doc["test_accuracy"] >= 0.90, doc
    assert doc["bytes_per_step"] > 0 and doc["images_per_sec"] > 0
    if spec != "none":
        assert doc["bytes_per_step"] < 153_128 / 2  # the uncompressed model is 153,128 bytes


def test_train_digits_with_backward_passes_per_step(launched):
    text = launched["bpps"][0]["out"]
    doc = _summary(launched, "bpps")
    assert doc["steps"] == 2 * (719 // 32)  # 719 training images on rank 0, batch 16 x 2
    assert "digits topk:ratio=0.05 np=2" in text  # the progress display
    # the accuracy curve: one point per epoch, in the training seconds images/s counts
    curve = doc["curve"]
    assert [p["epoch"] for p in curve] == [1, 2] and 0 < curve[0]["seconds"] < curve[1]["seconds"]
    assert curve[-1]["test_accuracy"] == doc["test_accuracy"]
    images = doc["steps"] * 32 * 2
    assert curve[-1]["seconds"] == pytest.approx(images / doc["images_per_sec"], rel=0.02)


def test_train_digits_stops_at_the_target_on_every_worker(launched):
    """--stop-at A: training ends after the first epoch whose test accuracy (rank 0's) is at
    least A, on both workers -- under local SGD, whose replicas score differently, too (a
    worker that went on would hang in its next average)."""
    doc = _summary(launched, "stop-at")
    assert doc["epochs"] == 1 and [p["epoch"] for p in doc["curve"]] == [1], doc
    assert doc["steps"] == 719 // 16 == 44 and doc["test_accuracy"] == doc["curve"][0]["test_accuracy"] >= 0.2
    assert doc["bytes_per_step"] == pytest.approx(153_128 * 11 / 44, rel=0.01)  # 11 averages, none after


def test_train_digits_wide_model_has_ten_million_parameters(launched):
    """Issue 19: real data where the link matters -- the digits under a 10.8M-parameter
    MLP, 43 MB of float32 gradients a step (compare's --example digits-wide)."""
    doc = _summary(launched, "wide")
    assert doc["bytes_per_step"] == 4 * 10_780_170 and doc["steps"] == 719 // 64
    assert doc["test_accuracy"] > 0.5


@pytest.mark.parametrize("run", range(len(LOCAL_FLAGS)), ids=["local-sgd", "dga"])
def test_train_digits_with_local_sgd_and_dga(run, launched):
    flags, bytes_ratio = LOCAL_FLAGS[run]
    doc = _summary(launched, f"local-{run}")
    assert doc["test_accuracy"] >= 0.90, doc
    assert doc["steps"] == 6 * (719 // 16)  # one backward pass per step in both
    assert doc["bytes_per_step"] == pytest.approx(153_128 * bytes_ratio, rel=0.01)
    assert doc["local_sgd"] == ("--local-sgd" in flags) and doc["delay"] == (2 if "--delay" in flags else 0)


# the command lines that exit before training, in one process (importing PyTorch and
# Horovod costs seconds a process): (script, arguments)
EARLY_EXITS = [("torch_examples/train_digits.py", ["--local-sgd", "--delay", "1"]),
               ("torch_examples/train_digits.py", ["--delay", "1", "--compression", "powersgd:rank=2"]),
               *[(script, args) for script in SCRIPTS
                 for args in (["--help"], ["--compression", "topk:ratio=9"])]]


@pytest.fixture(scope="module")
def early_exits():
    """``{(script, *arguments): (exit status, stdout, stderr)}`` of EARLY_EXITS."""
    got = run_scripts_in_one_process(EARLY_EXITS)
    return {(script, *args): result for (script, args), result in zip(EARLY_EXITS, got)}


def test_bad_local_sgd_flags_are_usage_errors(early_exits):
    code, _, err = early_exits["torch_examples/train_digits.py", "--local-sgd", "--delay", "1"]
    assert code == 2 and "cannot be combined" in err
    code, _, err = early_exits["torch_examples/train_digits.py", "--delay", "1", "--compression",
                               "powersgd:rank=2"]
    assert code == 2 and "one-round compressor" in err


@pytest.mark.parametrize("run", range(len(SYNTHETIC_EXTRA)), ids=["ours", "horovod-optimizer"])
def test_synthetic_benchmark(run, launched):
    extra = SYNTHETIC_EXTRA[run]
    assert "total img/sec on 2 workers" in launched[f"synthetic-{run}"][0]["out"]
    doc = _summary(launched, f"synthetic-{run}")
    assert doc["steps"] == 4 and doc["test_accuracy"] is None
    assert doc["horovod_optimizer"] is bool(extra)


def test_train_cifar10_reads_python_batches(launched):
    doc = _summary(launched, "cifar10")
    assert doc["example"] == "train_cifar10" and 0.0 <= doc["test_accuracy"] <= 1.0
    assert doc["steps"] == 2 * (60 // 8)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_and_bad_spec(script, early_exits):
    code, out, _ = early_exits[script, "--help"]
    assert code == 0 and "--compression" in out and "--json" in out
    code, _, err = early_exits[script, "--compression", "topk:ratio=9"]
    assert code == 2 and "topk: ratio must be in (0, 1], got 9" in err
