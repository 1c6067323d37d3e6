"""Where the examples' workers meet around an evaluation (``all_workers`` in
torch_examples/_common.py and tf_examples/_common.py): before each evaluation (timed) and
after each but the last (untimed), the same on every path a run can take -- a worker that
met once more than another would wait for it forever.  Counted in this process, one
worker (tests/test_torch_waiting.py and tests/test_tensorflow_examples.py check the
meeting itself under horovodrun)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from tests.harness import REPO

sys.path.insert(0, str(REPO / "torch_examples"))

TINY_LM = ["--steps", "12", "--eval-every", "4", "--batch-size", "2", "--context", "16",
           "--d-model", "16", "--layers", "1", "--heads", "2", "--val-windows", "4",
           "--warmup-steps", "2", "--quiet"]


def _count(monkeypatch, module, name="all_workers") -> list:
    met = []
    monkeypatch.setattr(module, name, lambda *a: met.append(a))
    return met


@pytest.mark.parametrize("extra, meetings", [
    ([], 2 + 2 + 1),  # evaluations at steps 4, 8 and 12 (the last: before it only)
    (["--diloco", "4"], 2 + 2 + 1),
    (["--target-loss", "100", "--stop-at-target"], 2),  # stops after the first evaluation
])
def test_the_language_model_meets_twice_an_evaluation_once_at_the_last(monkeypatch, extra,
                                                                         meetings):
    import train_lm
    met = _count(monkeypatch, train_lm)
    train_lm.main(TINY_LM + extra)
    assert len(met) == meetings, met


def test_the_epoch_loop_meets_twice_an_epoch_once_at_the_last(monkeypatch):
    import _common
    import train_digits
    met = _count(monkeypatch, _common)
    train_digits.main(["--epochs", "3", "--batch-size", "256", "--quiet"])
    assert len(met) == 2 + 2 + 1, met


def _tf_common():
    """tf_examples/_common.py under a name of its own (torch_examples' is ``_common``)."""
    spec = importlib.util.spec_from_file_location("tf_examples_common",
                                                  REPO / "tf_examples" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stop_after, meetings, stopped", [(None, 2 + 2 + 2, False), (1, 2, True)])
def test_the_keras_callback_meets_around_every_evaluation_but_the_last(stop_after, meetings,
                                                                       stopped):
    """4 epochs: the callback evaluates after epochs 1-3 (the caller, after ``fit``, the
    last); a stop after epoch 1 ends there on every worker."""
    common = _tf_common()
    keras = types.SimpleNamespace(callbacks=types.SimpleNamespace(Callback=object))
    met, seen = [], []

    def stop(accuracy):
        seen.append(accuracy)
        return stop_after is not None and len(seen) >= stop_after

    curve = common.curve_callback(keras, None, None, 3 + 1, stop, meet=lambda: met.append(1))
    curve.model = types.SimpleNamespace(evaluate=lambda x, y, verbose: [0.0, 0.5],
                                        stop_training=False)
    for epoch in range(4):
        if curve.stopped:
            break
        curve.on_epoch_end(epoch)
    assert len(met) == meetings and curve.stopped == stopped
    assert len(curve.points) == meetings // 2 and curve.eval_s >= 0
