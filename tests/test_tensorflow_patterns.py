"""Horovod's Keras callbacks, for Keras 3 (hvd_compress.tensorflow.keras.callbacks), with
our Keras optimizer under ``horovodrun -np 2 --gloo``; each checked against what
Horovod's documentation says it does (Horovod 0.28.1's own fail on Keras 3)."""

import numpy as np
import pytest

from tests.harness import run_horovod

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs():
    return run_horovod("tests.workers.tf_patterns:keras_callbacks", np=2, timeout=600)


def test_broadcast_gives_every_rank_roots_weights_and_keeps_residuals_local(runs):
    a, b = runs[0]["broadcast"], runs[1]["broadcast"]
    assert a["weights"] == b["weights"]
    assert runs[0]["no broadcast"]["weights"] != runs[1]["no broadcast"]["weights"]
    assert a["residuals"] and a["residuals"] != b["residuals"]  # each rank's own


def test_metric_average(runs):
    a, b = runs[0]["metric"]["loss"], runs[1]["metric"]["loss"]
    np.testing.assert_allclose(a, b, rtol=1e-6)
    plain = [r["no broadcast"]["loss"] for r in runs]
    assert plain[0] != plain[1]


def test_learning_rate_warmup_follows_goyal(runs):
    size, spe, lr0, warm = 2, 4, 0.1, 2
    want = []
    for epoch in range(3):
        for b in range(spe):
            if epoch < warm:
                e = epoch + b / spe + 1 / spe
                want.append(lr0 / size * (e * (size - 1) / warm + 1))
            else:
                want.append(want[-1])
    for rank in runs:
        np.testing.assert_allclose(rank["warmup"]["lr"], want, rtol=1e-6)
        assert rank["warmup"]["lr"][2 * spe - 1] == pytest.approx(lr0)


def test_learning_rate_schedule_staircase(runs):
    for rank in runs:
        np.testing.assert_allclose(rank["schedule"]["lr"], [0.1] * 4 + [0.1] * 4 + [0.05] * 4,
                                   rtol=1e-6)
