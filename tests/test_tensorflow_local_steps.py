"""Local SGD and Delayed Gradient Averaging in our TF tape and Keras optimizer.

Under real ``horovodrun -np 2``, eagerly and inside ``tf.function``, against
the numpy hand computation of tests/workers/local_hand.py.
"""

import numpy as np
import pytest

from tests.harness import run_horovod
from tests.workers.local_hand import check_local_log

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("api, spec, period, warmup, traced, exact", [
    ("tape", "none", 4, 0, False, 1e-5),   # the exact mean; messages counted eagerly
    ("keras", "none", 2, 3, True, 1e-5),   # post-local SGD inside tf.function
    ("tape", "fp16", 4, 0, True, 5e-3),    # changes since the last average, as fp16
    ("keras", "topk:ratio=0.4", 4, 0, False, np.inf),  # compressed: ranks agree after averages
    ("tape", "onebit", 4, 0, True, np.inf),
])
def test_local_sgd(api, spec, period, warmup, traced, exact):
    steps = 10
    results = run_horovod("tests.workers.tf_local_steps:local_sgd", np=2, timeout=600,
                          kwargs={"api": api, "spec": spec, "period": period, "steps": steps,
                                  "warmup": warmup, "traced": traced})
    check_local_log(results, period, warmup, steps, exact)
    for rank, log in enumerate(results):  # before the first average: the rank's own SGD
        assert np.abs(np.array(log[warmup]["params"][rank]) - log[warmup]["hand"]).max() < 1e-5


@pytest.mark.parametrize("api, traced", [("tape", False), ("keras", True)])
def test_dga_matches_the_hand_computed_correction(api, traced):
    results = run_horovod("tests.workers.tf_local_steps:dga", np=2, timeout=600,
                          kwargs={"api": api, "spec": "none", "delay": 2, "steps": 7,
                                  "traced": traced})
    for log in results:
        for step, entry in enumerate(log):
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5, step
        assert np.abs(np.array(log[-1]["params"]) - log[-1]["sync"]).max() > 1e-3
    assert results[0][-1]["params"] != results[1][-1]["params"]


def test_dga_eager_thread_and_traced_ring_agree_with_a_compressor():
    """Eagerly the exchange runs on a thread and is collected D steps later; traced, the
    averages wait in variables: the same arithmetic either way."""
    runs = [run_horovod("tests.workers.tf_local_steps:dga", np=2, timeout=600,
                        kwargs={"api": "tape", "spec": "topk:ratio=0.4", "delay": 2, "steps": 5,
                                "traced": traced}) for traced in (False, True)]
    for eager, traced in zip(*runs):
        for step, (a, b) in enumerate(zip(eager, traced)):
            assert np.abs(np.array(a["params"]) - b["params"]).max() < 1e-6, step
        for entry in eager[:2]:  # the first D steps are the worker's own
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5
        # every step, past D too: g_i - g_{i-D} + the top-k exchange's average of g_{i-D}
        # (numpy, the residuals carried in step order), eagerly and traced
        for step, entry in enumerate(eager):
            assert np.abs(np.array(entry["params"]) - entry["hand_compressed"]).max() < 1e-5, step
        for step, entry in enumerate(traced):
            assert np.abs(np.array(entry["params"]) - entry["hand_compressed"]).max() < 1e-5, step
        assert np.abs(np.array(eager[-1]["params"]) - eager[-1]["hand"]).max() > 1e-4  # compressed


def test_dga_with_delay_zero_is_synchronous_training():
    results = run_horovod("tests.workers.tf_local_steps:dga", np=2, timeout=600,
                          kwargs={"api": "tape", "spec": "none", "delay": 0, "steps": 4,
                                  "traced": True})
    for log in results:
        for entry in log:
            assert entry["params"] == entry["sync"]
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5
    assert results[0][-1]["params"] == results[1][-1]["params"]


def test_tf_wrappers_reject_bad_combinations():
    pytest.importorskip("tensorflow")
    import keras
    import tensorflow as tf

    import hvd_compress.tensorflow as hct
    with pytest.raises(ValueError, match="one-round compressor"):
        hct.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="powersgd:rank=1",
                                       delay=1, min_numel=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        hct.DistributedGradientTape(tf.GradientTape(), local_sgd=True, delay=1, min_numel=0)
