"""Local SGD and Delayed Gradient Averaging in our TF tape and Keras optimizer.

Under real ``horovodrun -np 2``, eagerly and inside ``tf.function``, against
the numpy hand computation of tests/workers/local_hand.py.
"""

import numpy as np
import pytest

from tests.launches import TF_GLOO
from tests.workers.local_hand import check_local_log

pytestmark = pytest.mark.multiprocess

LOCAL_SGD = [  # api, spec, period, warmup, traced, exact
    ("tape", "none", 4, 0, False, 1e-5),   # the exact mean; messages counted eagerly
    ("keras", "none", 2, 3, True, 1e-5),   # post-local SGD inside tf.function
    ("tape", "fp16", 4, 0, True, 5e-3),    # changes since the last average, as fp16
    ("keras", "topk:ratio=0.4", 4, 0, False, np.inf),  # compressed: ranks agree after averages
    ("tape", "onebit", 4, 0, True, np.inf),
]
LOCAL_STEPS = 10
DGA = [  # api, spec, delay, steps, traced
    ("tape", "none", 2, 7, False), ("keras", "none", 2, 7, True),
    ("tape", "topk:ratio=0.4", 2, 5, False), ("tape", "topk:ratio=0.4", 2, 5, True),
    ("tape", "none", 0, 4, True)]


def _key(kind, *args):
    return ":".join(map(str, (kind, *args)))


_W = "tests.workers.tf_local_steps:"
# every case one after another in one launch, with other modules' np 2 bodies
# (tests.launches; each builds its own model and optimizer)
for _c in LOCAL_SGD:
    TF_GLOO.add(__name__, _key("local_sgd", *_c[:5]), _W + "local_sgd",
                {"api": _c[0], "spec": _c[1], "period": _c[2], "steps": LOCAL_STEPS,
                 "warmup": _c[3], "traced": _c[4]})
for _c in DGA:
    TF_GLOO.add(__name__, _key("dga", *_c), _W + "dga",
                dict(zip(("api", "spec", "delay", "steps", "traced"), _c)))


@pytest.fixture(scope="module")
def logs(request):
    """``logs(key)``: per-rank logs of a case."""
    return lambda key: TF_GLOO.results(request, key)


@pytest.mark.parametrize("api, spec, period, warmup, traced, exact", LOCAL_SGD)
def test_local_sgd(api, spec, period, warmup, traced, exact, logs):
    steps = LOCAL_STEPS
    results = logs(_key("local_sgd", api, spec, period, warmup, traced))
    check_local_log(results, period, warmup, steps, exact)
    for rank, log in enumerate(results):  # before the first average: the rank's own SGD
        assert np.abs(np.array(log[warmup]["params"][rank]) - log[warmup]["hand"]).max() < 1e-5


@pytest.mark.parametrize("api, traced", [("tape", False), ("keras", True)])
def test_dga_matches_the_hand_computed_correction(api, traced, logs):
    results = logs(_key("dga", api, "none", 2, 7, traced))
    for log in results:
        for step, entry in enumerate(log):
            assert np.abs(np.array(entry["params"]) - entry["hand"]).max() < 1e-5, step
        assert np.abs(np.array(log[-1]["params"]) - log[-1]["sync"]).max() > 1e-3
    assert results[0][-1]["params"] != results[1][-1]["params"]


def test_dga_eager_thread_and_traced_ring_agree_with_a_compressor(logs):
    """Eagerly the exchange runs on a thread and is collected D steps later; traced, the
    averages wait in variables: the same arithmetic either way."""
    runs = [logs(_key("dga", "tape", "topk:ratio=0.4", 2, 5, traced)) for traced in (False, True)]
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


def test_dga_with_delay_zero_is_synchronous_training(logs):
    results = logs(_key("dga", "tape", "none", 0, 4, True))
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
