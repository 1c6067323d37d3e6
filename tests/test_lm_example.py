"""The language-model example (torch_examples/train_lm.py, issue 40): its data (the
standard library's source files: a fixed split, each worker its shard of every step's
batch), its model's causal mask, its flags, and tiny runs under horovodrun -np 2 (in the np 2 Gloo
launch other modules share: tests.launches)."""

import sys

import numpy as np
import pytest

from hvd_compress.tools import datasets
from hvd_compress.tools.runtools import SUMMARY_KEYS
from tests.harness import REPO
from tests.launches import TORCH_GLOO

sys.path.insert(0, str(REPO / "torch_examples"))
TINY = ["--steps", "12", "--eval-every", "4", "--batch-size", "4", "--context", "32",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--val-windows", "16",
        "--lr", "0.01", "--warmup-steps", "2", "--quiet"]
# {key: arguments before --json}: the runs of the one launch
RUNS = {"adamw": ["--target-loss", "5.0"],
        "topk": ["--compression", "topk:ratio=0.01", "--min-numel", "0"],
        "onebit": ["--optimizer", "onebit-adam", "--compression", "efsignsgd", "--exchange",
                   "two-phase", "--freeze-step", "6"],
        "diloco": ["--diloco", "4"]}


def test_the_split_is_by_file_and_the_same_every_time(tmp_path):
    files = []
    for i in range(12):
        files.append(tmp_path / f"f{i:02d}.py")
        files[-1].write_bytes(bytes([i]) * (i + 1))
    train, val = datasets.stdlib_text(val_every=5, files=files)
    assert val.tolist() == [4] * 5 + [9] * 10  # files 4 and 9
    assert train.tolist() == [b for i in range(12) if i % 5 != 4 for b in [i] * (i + 1)]
    real = datasets.stdlib_files()
    assert real == sorted(real) and len(real) > 50 and all(p.suffix == ".py" for p in real)
    tr, va = datasets.stdlib_text()
    assert len(tr) + len(va) == sum(p.stat().st_size for p in real)
    tr2, va2 = datasets.stdlib_text()
    assert np.array_equal(tr, tr2) and np.array_equal(va, va2) and len(va) > 0


def test_every_worker_takes_its_own_shard_of_one_global_batch():
    n, ctx, b = 10_000, 32, 5
    whole = datasets.lm_batch_starts(n, ctx, 2 * b, 0, 1, seed=3, step=7)
    shards = [datasets.lm_batch_starts(n, ctx, b, r, 2, seed=3, step=7) for r in range(2)]
    assert np.array_equal(np.concatenate(shards), whole)  # the same draw, split by rank
    assert not set(shards[0]) & set(shards[1])
    assert all(s % ctx == 0 and s + ctx + 1 <= n for s in whole)
    again = datasets.lm_batch_starts(n, ctx, b, 1, 2, seed=3, step=7)
    assert np.array_equal(again, shards[1])
    assert not np.array_equal(datasets.lm_batch_starts(n, ctx, b, 1, 2, seed=3, step=8), shards[1])
    assert not np.array_equal(datasets.lm_batch_starts(n, ctx, b, 1, 2, seed=4, step=7), shards[1])
    with pytest.raises(ValueError, match="a step needs 20"):
        datasets.lm_batch_starts(300, ctx, 10, 0, 2, 0, 0)
    val = datasets.lm_val_starts(n, ctx, 16)
    assert len(val) == 16 and val[0] == 0 and val[-1] + ctx + 1 <= n
    assert len(datasets.lm_val_starts(100, ctx, 16)) == 3  # all the windows there are


def test_the_model_is_causal():
    import torch
    from models import TinyLM
    torch.manual_seed(0)
    model = TinyLM(vocab=256, context=16, d_model=32, layers=2, heads=4).eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])  # earlier positions do not see position 9
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    assert model(x[:, :5]).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="exceed the context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_help(capsys):
    import train_lm  # (in this process: the flags tests import it too)
    with pytest.raises(SystemExit) as stop:
        train_lm.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith("usage: ")
    for flag in ("--optimizer", "--compression", "--diloco", "--outer-lr", "--fragments",
                 "--freeze-step", "--weight-decay", "--target-loss", "--steps", "--json",
                 "--lr-schedule"):
        assert flag in out, flag


def test_the_learning_rate_warms_up_then_stays_or_follows_a_cosine_to_a_tenth():
    import train_lm
    ap = train_lm.parser()
    const = ap.parse_args(["--lr", "0.01", "--warmup-steps", "4", "--steps", "104"])
    cos = ap.parse_args(["--lr", "0.01", "--warmup-steps", "4", "--steps", "104",
                         "--lr-schedule", "cosine"])
    for args in (const, cos):
        assert [train_lm.lr_at(args, s) for s in range(4)] == pytest.approx(
            [0.0025, 0.005, 0.0075, 0.01])
    assert {train_lm.lr_at(const, s) for s in range(4, 104)} == {0.01}
    rates = [train_lm.lr_at(cos, s) for s in range(4, 104)]
    assert rates[0] == pytest.approx(0.01) and rates[-1] == pytest.approx(0.001)
    assert rates[49] == pytest.approx(0.0055 + 0.0045 * np.cos(np.pi * 49 / 99))
    assert all(a > b for a, b in zip(rates, rates[1:]))  # falling at every step
    none = ap.parse_args(["--lr", "0.01", "--warmup-steps", "0", "--lr-schedule", "cosine",
                          "--steps", "1"])
    assert train_lm.lr_at(none, 0) == pytest.approx(0.01)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "sgd"], "invalid choice: 'sgd'"),
    (["--fragments", "2"], "--fragments needs --diloco H"),
    (["--target-loss", "-1"], "--target-loss is a loss > 0"),
    (["--stop-at-target"], "--stop-at-target needs --target-loss L"),
    (["--d-model", "30", "--heads", "4"], "not a multiple of --heads 4"),
    (["--diloco", "0"], "must be >= 1"),
    (["--diloco", "6", "--fragments", "4"], "must be a multiple of fragments (4)"),
    (["--diloco", "4", "--outer-momentum", "1"], "outer_momentum must be in [0, 1)"),
])
def test_bad_flags_are_refused_before_anything_starts(flags, message, capsys):
    import train_lm
    with pytest.raises(SystemExit) as stop:
        train_lm.main(flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err
    if "invalid" not in message and "must be" not in message:
        assert err.count("\n") == 1, err  # one line


def test_a_choice_this_version_lacks_is_refused_naming_what_is_missing(capsys):
    """Until hvd_compress.torch has the Adam-family classes and DiLoCo's keywords, asking for
    them is a one-line usage error naming the missing piece; once there, the flags pass."""
    import inspect

    import train_lm

    import hvd_compress.torch as hc
    cases = [(["--optimizer", o], f"hvd_compress.torch.{c}", hasattr(hc, c))
             for o, c in train_lm.CLASSES.items()]
    keywords = inspect.signature(hc.DistributedOptimizer).parameters
    cases.append((["--diloco", "4"], "outer_lr", all(k in keywords for k in train_lm.DILOCO_KEYWORDS)))
    for flags, missing, present in cases:
        ap = train_lm.parser()
        args = ap.parse_args(flags)
        if present:
            train_lm.check_args(ap, args)
            continue
        with pytest.raises(SystemExit) as stop:
            train_lm.check_args(ap, args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and missing in err and err.count("\n") == 1, err
    ap = train_lm.parser()
    with pytest.raises(SystemExit):  # DiLoCo runs AdamW inside
        train_lm.check_args(ap, ap.parse_args(["--diloco", "4", "--delay", "1"]))


TORCH_GLOO.add(__name__, "runs", "tests.workers.lm_example:run",
               {"runs": [[key, TINY + args] for key, args in RUNS.items()]})


@pytest.fixture(scope="module")
def runs(request):
    """Every run of RUNS in the shared np 2 Gloo launch: {key: rank 0's summary}."""
    return TORCH_GLOO.results(request, "runs")[0]


@pytest.mark.multiprocess
def test_a_tiny_run_at_np_2_learns_and_reports_what_compare_reads(runs):
    doc = runs["adamw"]
    assert set(SUMMARY_KEYS) <= set(doc)
    assert (doc["example"], doc["np"], doc["steps"], doc["optimizer"]) == ("train_lm", 2, 12, "adamw")
    assert doc["tokens_per_step"] == 2 * 4 * 32
    assert doc["tokens_per_sec"] == doc["images_per_sec"] > 0
    losses = doc["loss_per_step"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    curve = doc["curve"]
    assert [p["step"] for p in curve] == [4, 8, 12]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] and doc["val_loss"] == curve[-1]["val_loss"]
    assert all(a["seconds"] < b["seconds"] for a, b in zip(curve, curve[1:]))
    # dense: every gradient summed, and wire bytes in and out of a worker alike
    assert doc["bytes_per_step"] >= 4 * doc["parameters"]
    assert doc["wire_in_per_step"] == doc["wire_out_per_step"] > 0
    first = next(p for p in curve if p["val_loss"] <= 5.0)
    assert (doc["time_to_target_s"], doc["steps_to_target"]) == (first["seconds"], first["step"])
    topk = runs["topk"]
    assert topk["compression"] == "topk:ratio=0.01"
    assert topk["bytes_per_step"] < doc["bytes_per_step"] / 10
    assert topk["time_to_target_s"] is None and topk["target_loss"] is None


@pytest.mark.multiprocess
def test_the_adam_family_and_diloco_are_wired_as_asked(runs):
    """The example hands its flags to the optimizers (their arithmetic: tests/test_adam*.py,
    tests/test_diloco.py): 1-bit Adam sends dense for --freeze-step steps, then 1-bit
    momentum; DiLoCo sends every H-th step; both learn."""
    dense = runs["adamw"]
    for key, optimizer in (("onebit", "onebit-adam"), ("diloco", "adamw")):
        doc = runs[key]
        assert doc["optimizer"] == optimizer and doc["steps"] == 12
        assert doc["curve"][-1]["val_loss"] < doc["curve"][0]["val_loss"], doc["curve"]
    one = runs["onebit"]
    assert (one["compression"], one["exchange"]) == ("efsignsgd", "two-phase")
    # --freeze-step 6 of 12 steps: six dense (Horovod's broadcast_optimizer_state makes the
    # state without a step of the rule), six of 1-bit momentum
    assert 6 / 12 * dense["bytes_per_step"] <= one["bytes_per_step"] < 7 / 12 * dense["bytes_per_step"]
    lo = runs["diloco"]
    assert (lo["diloco"], lo["outer_lr"], lo["outer_momentum"], lo["fragments"]) == (4, 0.7, 0.9, 1)
    assert lo["local_sgd"] and lo["backward_passes_per_step"] == 4
    assert lo["bytes_per_step"] <= dense["bytes_per_step"] / 3  # three syncs in 12 steps

